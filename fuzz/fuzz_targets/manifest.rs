//! The manifest loader (cyberwave.yml or README front matter), strict and lenient. The first byte
//! picks the mode and the file name; the rest is the text.
#![no_main]
use std::path::Path;

use cyberwave_cloud_node::config::manifest::parse;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let text = String::from_utf8_lossy(rest);
    let path = if mode & 2 == 0 {
        Path::new("cyberwave.yml")
    } else {
        Path::new("README.md")
    };
    let (_manifest, problems) = parse(path, &text, mode & 1 == 1);
    for p in problems {
        let _ = p.to_string();
    }
});
