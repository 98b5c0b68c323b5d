//! A message to the fork server, read as the fork server reads it: whatever it is, an answer
//! (never a panic); what it accepts names the supervisor first and a directory, and sent again
//! it reads back the same.
#![no_main]
use std::collections::BTreeMap;
use std::os::unix::ffi::OsStrExt;

use cyberwave_cloud_node::workload::forkserver::{decode, encode, well_formed, MAX_REQUEST};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The fork server's own check (no allocation) says what decode says.
    assert_eq!(well_formed(data), decode(data).is_ok());
    let Ok(req) = decode(data) else {
        return;
    };
    assert_eq!(req.args.first().map(|a| a.as_bytes()), Some(&b"__shim"[..]));
    assert!(!req.dir.as_os_str().is_empty());
    // Text environments go back out the way the node sends them.
    let env: Option<BTreeMap<String, String>> = req
        .env
        .iter()
        .map(|(k, v)| Some((k.to_str()?.to_string(), v.to_str()?.to_string())))
        .collect();
    if let Some(env) = env {
        if env.len() == req.env.len() && data.len() <= MAX_REQUEST {
            let again = encode(&req.args, &env, &req.dir).expect("re-encodable");
            let back = decode(&again).expect("reads back");
            assert_eq!(back.args, req.args);
            assert_eq!(back.dir, req.dir);
        }
    }
});
