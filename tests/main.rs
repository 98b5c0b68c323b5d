//! Integration tests: the real binary against a real mosquitto and a fake control plane.

mod support;

mod cli_config;
mod edge;
mod gpu;
mod ingress;
mod lifecycle;
mod logs;
mod operate;
mod platform;
mod results;
mod statedir;
mod wire;
mod workloads;
