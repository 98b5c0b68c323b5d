# Module dispatch for cyberwave-cloud-node: imports the manifest's .py file and calls its
# infer/train/simulate function with the request's params as keyword arguments. The node writes
# this file into the workload's directory and runs it as the workload process (tracked, streamed,
# cancellable like a shell command). Arguments: module path, function name, params file, and the
# manifest value (for messages). Exit codes: the function's exception -> 1 (Python's own), the
# module cannot be loaded or lacks the function -> 2.
import importlib.util
import json
import os
import sys
import traceback


def fail(message):
    sys.stderr.write(message + "\n")
    sys.exit(2)


def main():
    path, fn_name, params_path, label = sys.argv[1:5]
    # The working dir is often a read-only checkout: leave no __pycache__ behind in it.
    sys.dont_write_bytecode = True
    sys.argv = [path]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    name = "_cyberwave_" + fn_name + "_module"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        fail("Cannot load module: " + label)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - any import error is the user's to see
        traceback.print_exc()
        fail("Module import failed: " + str(e))
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        fail(
            "Module %s does not export %s(). Add 'def %s(**params): ...' to the module."
            % (label, fn_name, fn_name)
        )
    with open(params_path, encoding="utf-8") as f:
        params = json.load(f)
    result = fn(**params)
    if result is not None:
        text = result if isinstance(result, str) else json.dumps(result, default=str)
        print(text, flush=True)


main()
