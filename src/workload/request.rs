//! What a start asks for: the request the node's loop hands to the spawner thread, read by the
//! steps that write the workload's inputs ([`super::inputs`]) and launch it ([`super::launch`]).

use std::path::PathBuf;

use serde_json::{Map, Value};

use super::record::WorkflowCtx;
use crate::protocol::commands::{Kind, TopicId};

/// What a start needs beyond the settings (owned: it travels to the spawner thread).
#[derive(Debug, Clone)]
pub struct StartRequest {
    pub kind: Kind,
    pub request_id: Value,
    pub safe_id: String,
    pub params: Map<String, Value>,
    /// The workload's uuid as the edge typed it (`"None"`, `""` and `null` are none; D20).
    pub workload_uuid: Option<TopicId>,
    pub template: String,
    /// The node's own API token (empty in standalone mode).
    pub node_token: String,
    pub max_runtime_s: Option<f64>,
    pub workflow: Option<WorkflowCtx>,
    /// The node's control socket, for `emit`.
    pub socket: PathBuf,
    /// Its GPUs (D36): `Some` sets the CUDA/NVIDIA variables (an empty list hides every GPU).
    pub gpus: Option<Vec<String>>,
    /// This workload's own results folder (D24), when result uploads are on (created by the
    /// spawner; a folder it cannot create is not passed on).
    pub results_dir: Option<PathBuf>,
    /// Its secret for `emit` (chosen by the node, which must know it before the workload runs).
    pub event_token: String,
    /// The node's instance UUID (`CYBERWAVE_CLOUD_NODE_ID`, D45).
    pub node_uuid: String,
    /// The user it runs as (D46.3): with a pool, one no other running workload holds (D65).
    pub user: Option<super::user::WorkloadUser>,
}
