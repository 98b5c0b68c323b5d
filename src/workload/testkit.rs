//! Fixtures shared by the workload module's unit tests.

use serde_json::Value;

use super::record::Layout;

pub fn scratch(tag: &str) -> Layout {
    let state = std::env::temp_dir().join(format!("cw-wl-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&state);
    std::fs::create_dir_all(state.join("workloads/w1")).unwrap();
    std::fs::create_dir_all(state.join("workload_logs")).unwrap();
    Layout { state }
}

pub fn good_meta(layout: &Layout) -> Value {
    serde_json::json!({
        "safe_id": "w1", "kind": "inference", "request_id": "r1",
        "workload_uuid": "wl-1", "created_unix": 1.7e9, "command": "echo hi",
        "stdout_log": layout.logs().join("inference_w1.stdout.log"),
        "stderr_log": layout.logs().join("inference_w1.stderr.log"),
        "max_runtime_s": 60.0,
        "started": {"pid": 123456, "start_ticks": 5, "shim_pid": 123455,
                    "shim_start_ticks": 4, "boot_id": "b", "started_at": "t"},
        "event_token": "abc123"
    })
}
