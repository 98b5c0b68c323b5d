//! Integration tests: the real binary against a real mosquitto and a fake control plane.

mod support;

mod cli_config;
mod ingress;
mod logs;
mod operate;
mod persist;
mod results;
mod wire;
mod workloads;
