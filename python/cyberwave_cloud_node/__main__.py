"""``python -m cyberwave_cloud_node …``: the node binary with the same arguments."""
from cyberwave_cloud_node import main

main()
