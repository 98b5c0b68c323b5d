//! Integration tests: the real binary against a real mosquitto and a fake control plane.

mod support;

mod cli_config;
mod hostile;
mod ingress;
mod logs;
mod operate;
mod results;
mod wire;
mod workloads;
