//! The files the node reads back from its state dir after a restart: the first byte picks the
//! record (workload meta, shim start and exit records, outbox entry, ledger lines, log cursor,
//! instance identity, credentials, what a workload left running, the services record); the rest
//! is the file's bytes.
#![no_main]
use cyberwave_cloud_node::config::credentials::Identity;
use cyberwave_cloud_node::ledger::Entry;
use cyberwave_cloud_node::node::streams::Cursor;
use cyberwave_cloud_node::outbox::Item;
use cyberwave_cloud_node::store::parse_record;
use cyberwave_cloud_node::workload::services::{Left, Tracked};
use cyberwave_cloud_node::workload::shim::{Exit, Started};
use cyberwave_cloud_node::workload::Meta;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&which, bytes)) = data.split_first() else {
        return;
    };
    match which % 10 {
        0 => {
            if let Ok(m) = serde_json::from_slice::<Meta>(bytes) {
                // (Not failure_summary: it reads the log files the record names.)
                let _ = (m.pid(), m.request_id_text());
            }
        }
        1 => {
            let _ = serde_json::from_slice::<Started>(bytes);
        }
        2 => {
            if let Ok(e) = serde_json::from_slice::<Exit>(bytes) {
                let _ = e.code();
            }
        }
        3 => {
            let _ = serde_json::from_slice::<Item>(bytes);
        }
        4 => {
            // The ledger is JSON lines; a bad line is skipped.
            let text = String::from_utf8_lossy(bytes);
            for line in text.lines() {
                let _ = serde_json::from_str::<Entry>(line);
            }
        }
        5 => {
            let _ = serde_json::from_slice::<Cursor>(bytes);
        }
        6 => {
            let _ = serde_json::from_slice::<Identity>(bytes);
        }
        8 => {
            let _ = parse_record::<Left>(bytes);
        }
        9 => {
            let _ = parse_record::<Tracked>(bytes);
        }
        _ => {
            // credentials.json: any JSON object, read key by key.
            let _ = serde_json::from_slice::<serde_json::Value>(bytes);
        }
    }
});
