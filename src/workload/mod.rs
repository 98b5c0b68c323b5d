//! Workloads: the persisted record of each one, and how one is started (params file, command
//! rendering, environment, the shim). The node's event loop owns the table of active workloads
//! (`node/workloads.rs`); this module holds no state of its own.

pub mod environment;
pub mod error;
pub mod exit;
pub mod inputs;
pub mod launch;
pub mod lifecycle;
pub mod procinfo;
pub mod reaper;
pub mod record;
pub mod recover;
pub mod request;
pub mod results;
pub mod services;
pub mod shim;
pub mod spawner;
pub mod summary;
pub mod tail;
#[cfg(test)]
pub(crate) mod testkit;
pub mod user;

pub use environment::NODE_ONLY_VARS;
pub use error::SpawnError;
pub use exit::load_exit;
pub use inputs::{base64_decode, module_function, module_of, shell_quote};
pub use launch::launch;
pub use launch::Launched;
pub use record::{
    load_json, load_meta, parse_meta_bytes, read_json, save_meta, unix_now, Cancel, Layout, Meta,
    MetaKind, WorkflowCtx, KINDS, UNKNOWN_KIND,
};
pub use recover::{recover_meta, Recovered};
pub use request::StartRequest;
pub use spawner::{make_durable, settle};
pub use summary::{failure_summary, tail};
