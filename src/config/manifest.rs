//! `cyberwave.yml`: the `cyberwave:` wrapper (new), `cyberwave-cloud-node:` (legacy) or a flat
//! root; README.md front matter when no file exists. Every field is checked here, and every
//! problem is reported with the file and line it sits on, so `validate` can list them all.

use std::path::{Path, PathBuf};

use serde_yaml::Value;

/// One problem found in a manifest.
#[derive(Debug, Clone, PartialEq)]
pub struct Problem {
    pub file: PathBuf,
    pub line: Option<usize>,
    pub field: String,
    pub message: String,
    pub warning: bool,
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = if self.warning { "warning" } else { "error" };
        match self.line {
            Some(l) => write!(
                f,
                "{}:{l}: {kind}: {}: {}",
                self.file.display(),
                self.field,
                self.message
            ),
            None => write!(
                f,
                "{}: {kind}: {}: {}",
                self.file.display(),
                self.field,
                self.message
            ),
        }
    }
}

/// The values a manifest can set. `None` means "not in the file".
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Manifest {
    pub path: PathBuf,
    pub wrapper: Option<String>,
    pub name: Option<String>,
    pub install: Option<String>,
    pub inference: Option<String>,
    pub simulate: Option<String>,
    pub training: Option<String>,
    pub profile_slug: Option<String>,
    pub heartbeat_interval: Option<f64>,
    pub upload_results: Option<bool>,
    pub results_folder: Option<String>,
    pub mqtt_host: Option<String>,
    pub mqtt_port: Option<u16>,
    pub mqtt_use_tls: Option<bool>,
    pub mqtt_tls_ca_certs: Option<String>,
    pub mqtt_username: Option<String>,
    pub mqtt_password: Option<String>,
    pub environment_uuid: Option<String>,
    pub max_concurrent_workloads: Option<u32>,
    pub max_runtime_seconds: Option<f64>,
    pub workflow_reporting: Option<bool>,
    pub min_free_disk_mb: Option<u64>,
    pub max_log_bytes: Option<u64>,
    pub log_retention_days: Option<u64>,
}

#[derive(Clone, Copy)]
enum Kind {
    Str,
    StrList,
    StrOrList,
    Bool,
    Version,
    /// A number of seconds > 0 (fractions allowed).
    Seconds,
    Port,
    /// A whole number ≥ the bound.
    Int(i64),
    Resources,
    OnOff,
}

impl Kind {
    fn expected(self) -> &'static str {
        match self {
            Kind::Str => "a string",
            Kind::StrList => "a list of strings",
            Kind::StrOrList => "a string or a list of strings",
            Kind::Bool => "true or false",
            Kind::Version => "\"1\"",
            Kind::Seconds => "a number of seconds greater than 0",
            Kind::Port => "a whole number from 1 to 65535",
            Kind::Int(0) => "a whole number ≥ 0",
            Kind::Int(_) => "a whole number ≥ 1",
            Kind::Resources => "a mapping with `memory` (string) and `cpus` (number)",
            Kind::OnOff => "on or off",
        }
    }
}

/// Every key a manifest may hold: the SDK's `ManifestSchema` fields plus the node's own.
const FIELDS: &[(&str, Kind)] = &[
    ("version", Kind::Version),
    ("name", Kind::Str),
    ("install", Kind::Str),
    ("install_script", Kind::Str),
    ("requirements", Kind::StrList),
    ("models", Kind::StrList),
    ("inference", Kind::Str),
    ("training", Kind::Str),
    ("simulate", Kind::Str),
    ("workers", Kind::StrList),
    ("input", Kind::StrOrList),
    ("gpu", Kind::Bool),
    ("runtime", Kind::Str),
    ("model", Kind::Str),
    ("profile_slug", Kind::Str),
    ("heartbeat_interval", Kind::Seconds),
    ("upload_results", Kind::Bool),
    ("results_folder", Kind::Str),
    ("resources", Kind::Resources),
    ("mqtt_host", Kind::Str),
    ("mqtt_port", Kind::Port),
    ("mqtt_use_tls", Kind::Bool),
    ("mqtt_tls_ca_certs", Kind::Str),
    ("mqtt_username", Kind::Str),
    ("mqtt_password", Kind::Str),
    ("environment_uuid", Kind::Str),
    ("max_concurrent_workloads", Kind::Int(1)),
    ("max_runtime_seconds", Kind::Seconds),
    ("workflow_reporting", Kind::OnOff),
    ("min_free_disk_mb", Kind::Int(0)),
    ("max_log_bytes", Kind::Int(1)),
    ("log_retention_days", Kind::Int(0)),
];

pub const WRAPPER_NEW: &str = "cyberwave";
pub const WRAPPER_LEGACY: &str = "cyberwave-cloud-node";

/// Which file to read: an explicit path (its README.md front matter when it does not exist),
/// else `./cyberwave.yml`, else `./README.md` front matter. `Ok(None)`: no manifest at all.
pub fn locate(explicit: Option<&Path>, cwd: &Path) -> Result<Option<(PathBuf, String)>, String> {
    let (yml, readme) = match explicit {
        Some(p) => (
            p.to_path_buf(),
            p.parent().unwrap_or(Path::new(".")).join("README.md"),
        ),
        None => (cwd.join("cyberwave.yml"), cwd.join("README.md")),
    };
    match std::fs::read_to_string(&yml) {
        Ok(text) => return Ok(Some((yml, text))),
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(format!("cannot read {}: {e}", yml.display()))
        }
        Err(_) => {}
    }
    if let Ok(text) = std::fs::read_to_string(&readme) {
        if let Some(front) = front_matter(&text) {
            return Ok(Some((readme, front)));
        }
    }
    match explicit {
        Some(p) => Err(format!(
            "config file {} does not exist (and no README.md with front matter beside it)",
            p.display()
        )),
        None => Ok(None),
    }
}

/// The YAML between the first two `---` lines of a README, with blank lines in front so that
/// line numbers in problems point at the README's own lines.
fn front_matter(text: &str) -> Option<String> {
    let lines: Vec<&str> = text.lines().collect();
    let first = lines.iter().position(|l| l.trim_end() == "---")?;
    let body = lines.get(first.saturating_add(1)..)?;
    let len = body.iter().position(|l| l.trim_end() == "---")?;
    let mut out = "\n".repeat(first.saturating_add(1));
    out.push_str(&body.get(..len)?.join("\n"));
    Some(out)
}

/// Parses manifest text. Returns the manifest (present when no error was found) and every
/// problem. With `lenient`, unknown keys are warnings instead of errors.
pub fn parse(path: &Path, text: &str, lenient: bool) -> (Option<Manifest>, Vec<Problem>) {
    let mut problems = Vec::new();
    let problem = |line: Option<usize>, field: &str, message: String, warning: bool| Problem {
        file: path.to_path_buf(),
        line,
        field: field.to_string(),
        message,
        warning,
    };
    let root: Value = match serde_yaml::from_str(text) {
        Ok(v) => v,
        Err(e) => {
            let line = e.location().map(|l| l.line());
            let msg = e.to_string();
            // serde's message repeats the location; keep only the description.
            let msg = msg.split(" at line ").next().unwrap_or(&msg).to_string();
            problems.push(problem(line, "yaml", msg, false));
            return (None, problems);
        }
    };
    let root = match root {
        Value::Null => Value::Mapping(Default::default()),
        Value::Mapping(m) => Value::Mapping(m),
        other => {
            problems.push(problem(
                Some(1),
                "structure",
                format!(
                    "the file must be a mapping of settings, found {}",
                    describe(&other)
                ),
                false,
            ));
            return (None, problems);
        }
    };
    let root_map = root.as_mapping().cloned().unwrap_or_default();
    let has = |k: &str| root_map.contains_key(Value::String(k.to_string()));
    let wrapper = if has(WRAPPER_NEW) {
        if has(WRAPPER_LEGACY) {
            problems.push(problem(
                key_line(text, None, WRAPPER_LEGACY),
                WRAPPER_LEGACY,
                format!("ignored: `{WRAPPER_NEW}:` is also present and wins"),
                true,
            ));
        }
        Some(WRAPPER_NEW)
    } else if has(WRAPPER_LEGACY) {
        Some(WRAPPER_LEGACY)
    } else {
        None
    };
    let config = match wrapper {
        Some(w) => match root_map.get(Value::String(w.to_string())) {
            Some(Value::Mapping(m)) => m.clone(),
            Some(Value::Null) | None => Default::default(),
            Some(other) => {
                problems.push(problem(
                    key_line(text, None, w),
                    w,
                    format!(
                        "expected a mapping of settings under `{w}:`, found {}",
                        describe(other)
                    ),
                    false,
                ));
                return (None, problems);
            }
        },
        None => root_map.clone(),
    };
    if wrapper.is_some() {
        for (k, _) in root_map.iter() {
            let k = key_text(k);
            if k != WRAPPER_NEW && k != WRAPPER_LEGACY {
                problems.push(problem(
                    key_line(text, None, &k),
                    &k,
                    format!(
                        "unknown top-level key (settings belong under `{}:`)",
                        wrapper.unwrap_or_default()
                    ),
                    lenient,
                ));
            }
        }
    }

    let mut m = Manifest {
        path: path.to_path_buf(),
        wrapper: wrapper.map(String::from),
        ..Default::default()
    };
    for (k, v) in config.iter() {
        let key = key_text(k);
        let line = key_line(text, wrapper, &key);
        let Some(&(_, kind)) = FIELDS.iter().find(|(n, _)| *n == key) else {
            let hint = closest(&key)
                .map(|s| format!(" (did you mean `{s}`?)"))
                .unwrap_or_default();
            let tail = if lenient { "; ignored (--lenient)" } else { "" };
            problems.push(problem(
                line,
                &key,
                format!("unknown field{hint}{tail}"),
                lenient,
            ));
            continue;
        };
        if v.is_null() {
            continue; // an explicit null is the same as leaving the key out
        }
        if let Err(got) = check(kind, v) {
            problems.push(problem(
                line,
                &key,
                format!("expected {}, got {got}", kind.expected()),
                false,
            ));
            continue;
        }
        let s = || v.as_str().map(String::from);
        match key.as_str() {
            "name" => m.name = s(),
            "install" => m.install = s(),
            "install_script" if m.install.is_none() => m.install = s(),
            "inference" => m.inference = s(),
            "simulate" => m.simulate = s(),
            "training" => m.training = s(),
            "profile_slug" => m.profile_slug = s(),
            "heartbeat_interval" => m.heartbeat_interval = v.as_f64(),
            "upload_results" => m.upload_results = v.as_bool(),
            "results_folder" => m.results_folder = s(),
            "mqtt_host" => m.mqtt_host = s(),
            "mqtt_port" => m.mqtt_port = v.as_u64().and_then(|p| u16::try_from(p).ok()),
            "mqtt_use_tls" => m.mqtt_use_tls = v.as_bool(),
            "mqtt_tls_ca_certs" => m.mqtt_tls_ca_certs = s(),
            "mqtt_username" => m.mqtt_username = s(),
            "mqtt_password" => m.mqtt_password = s(),
            "environment_uuid" => m.environment_uuid = s().filter(|s| !s.trim().is_empty()),
            "max_concurrent_workloads" => {
                m.max_concurrent_workloads = v.as_u64().map(|n| n.min(u64::from(u32::MAX)) as u32)
            }
            "max_runtime_seconds" => m.max_runtime_seconds = v.as_f64(),
            "workflow_reporting" => m.workflow_reporting = on_off(v),
            "min_free_disk_mb" => m.min_free_disk_mb = v.as_u64(),
            "max_log_bytes" => m.max_log_bytes = v.as_u64(),
            "log_retention_days" => m.log_retention_days = v.as_u64(),
            _ => {} // schema fields the node accepts but does not act on (requirements, gpu, …)
        }
    }
    // `install` wins over `install_script` whatever their order in the file.
    if let Some(Value::String(s)) = config.get(Value::String("install".into())) {
        m.install = Some(s.clone());
    }
    let runtime = config
        .get(Value::String("runtime".into()))
        .is_some_and(|v| !v.is_null());
    let model = config
        .get(Value::String("model".into()))
        .is_some_and(|v| !v.is_null());
    if runtime && !model && m.inference.is_none() {
        problems.push(problem(
            key_line(text, wrapper, "runtime"),
            "runtime",
            "`runtime` needs `model` or `inference` as well".to_string(),
            false,
        ));
    }
    let ok = !problems.iter().any(|p| !p.warning);
    (ok.then_some(m), problems)
}

fn check(kind: Kind, v: &Value) -> Result<(), String> {
    let ok = match kind {
        Kind::Str => v.is_string(),
        Kind::StrList => v
            .as_sequence()
            .is_some_and(|s| s.iter().all(Value::is_string)),
        Kind::StrOrList => {
            v.is_string()
                || v.as_sequence()
                    .is_some_and(|s| s.iter().all(Value::is_string))
        }
        Kind::Bool => v.is_bool(),
        Kind::Version => v.as_str() == Some("1") || v.as_u64() == Some(1),
        Kind::Seconds => v.as_f64().is_some_and(|f| f.is_finite() && f > 0.0),
        Kind::Port => v.as_u64().is_some_and(|p| (1..=65535).contains(&p)),
        Kind::Int(min) => {
            v.as_i64().is_some_and(|n| n >= min) || (v.as_u64().is_some() && min <= 0)
        }
        Kind::Resources => v.as_mapping().is_some_and(|m| {
            m.iter().all(|(k, val)| match k.as_str() {
                Some("memory") => val.is_string() || val.is_null(),
                Some("cpus") => val.as_f64().is_some() || val.is_null(),
                _ => false,
            })
        }),
        Kind::OnOff => on_off(v).is_some(),
    };
    if ok {
        Ok(())
    } else {
        Err(describe(v))
    }
}

fn on_off(v: &Value) -> Option<bool> {
    match v {
        Value::Bool(b) => Some(*b),
        Value::String(s) => match s.trim().to_ascii_lowercase().as_str() {
            "on" => Some(true),
            "off" => Some(false),
            _ => None,
        },
        _ => None,
    }
}

fn describe(v: &Value) -> String {
    match v {
        Value::Null => "nothing (null)".into(),
        Value::Bool(b) => format!("{b}"),
        Value::Number(n) => format!("{n}"),
        Value::String(s) => format!("the string {:?}", s.chars().take(40).collect::<String>()),
        Value::Sequence(_) => "a list".into(),
        Value::Mapping(_) => "a mapping".into(),
        Value::Tagged(_) => "a tagged value".into(),
    }
}

fn key_text(k: &Value) -> String {
    match k {
        Value::String(s) => s.clone(),
        other => serde_yaml::to_string(other)
            .unwrap_or_default()
            .trim()
            .to_string(),
    }
}

/// The 1-based line of `key:` in the manifest text: at the top level when `wrapper` is `None`,
/// else indented below the wrapper's line. A best-effort text scan (YAML values carry no
/// positions); `None` when the key cannot be found.
fn key_line(text: &str, wrapper: Option<&str>, key: &str) -> Option<usize> {
    let matches_key = |line: &str| {
        let t = line.trim_start();
        [
            format!("{key}:"),
            format!("\"{key}\":"),
            format!("'{key}':"),
        ]
        .iter()
        .any(|p| t.starts_with(p.as_str()))
    };
    let indented = |line: &str| line.starts_with(' ') || line.starts_with('\t');
    let mut lines = text.lines().enumerate();
    if let Some(w) = wrapper {
        lines
            .by_ref()
            .find(|(_, l)| !indented(l) && matches_key_of(l, w))?;
        for (i, l) in lines {
            if !indented(l) && !l.trim().is_empty() && !l.trim_start().starts_with('#') {
                return None; // left the wrapper's block
            }
            if matches_key(l) {
                return Some(i.saturating_add(1));
            }
        }
        None
    } else {
        lines
            .find(|(_, l)| !indented(l) && matches_key(l))
            .map(|(i, _)| i.saturating_add(1))
    }
}

fn matches_key_of(line: &str, key: &str) -> bool {
    let t = line.trim_start();
    t.starts_with(&format!("{key}:")) || t.starts_with(&format!("\"{key}\":"))
}

/// A known field within edit distance 2 of `key`, for "did you mean" hints.
fn closest(key: &str) -> Option<&'static str> {
    FIELDS
        .iter()
        .map(|(n, _)| (*n, edit_distance(key, n)))
        .filter(|(_, d)| *d <= 2)
        .min_by_key(|(_, d)| *d)
        .map(|(n, _)| n)
}

// `prev` and `cur` hold b.len() + 1 entries and j < b.len(); a distance is at most a.len() + b.len().
#[allow(clippy::indexing_slicing, clippy::arithmetic_side_effects)]
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            cur.push(
                (prev[j] + usize::from(ca != *cb))
                    .min(prev[j + 1] + 1)
                    .min(cur[j] + 1),
            );
        }
        prev = cur;
    }
    prev[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(text: &str) -> (Option<Manifest>, Vec<Problem>) {
        parse(Path::new("cyberwave.yml"), text, false)
    }

    #[test]
    fn reads_new_wrapper() {
        let (m, probs) = p("cyberwave:\n  inference: python i.py {body}\n  install: ./i.sh\n  heartbeat_interval: 5\n");
        assert!(probs.is_empty(), "{probs:?}");
        let m = m.unwrap();
        assert_eq!(m.wrapper.as_deref(), Some("cyberwave"));
        assert_eq!(m.inference.as_deref(), Some("python i.py {body}"));
        assert_eq!(m.install.as_deref(), Some("./i.sh"));
        assert_eq!(m.heartbeat_interval, Some(5.0));
    }

    #[test]
    fn reads_legacy_wrapper_and_install_script() {
        let (m, probs) =
            p("cyberwave-cloud-node:\n  install_script: ./setup.sh\n  training: t {body}\n");
        assert!(probs.is_empty(), "{probs:?}");
        let m = m.unwrap();
        assert_eq!(m.wrapper.as_deref(), Some("cyberwave-cloud-node"));
        assert_eq!(m.install.as_deref(), Some("./setup.sh"));
        assert_eq!(m.training.as_deref(), Some("t {body}"));
    }

    #[test]
    fn install_beats_install_script_in_any_order() {
        let (m, _) = p("install: new\ninstall_script: old\n");
        assert_eq!(m.unwrap().install.as_deref(), Some("new"));
    }

    #[test]
    fn reads_flat_root_and_empty_files() {
        let (m, probs) = p("simulate: s {body}\nmqtt_port: 1883\nmqtt_use_tls: false\n");
        assert!(probs.is_empty());
        let m = m.unwrap();
        assert_eq!(m.wrapper, None);
        assert_eq!(m.mqtt_port, Some(1883));
        assert_eq!(m.mqtt_use_tls, Some(false));
        assert!(p("").0.is_some());
        assert!(
            p("cyberwave-cloud-node:\n").0.is_some(),
            "an empty wrapper is not a crash"
        );
    }

    #[test]
    fn unknown_key_names_key_file_and_line() {
        let (m, probs) = p("cyberwave:\n  inference: x\n  # c\n  provider: aws\n");
        assert!(m.is_none());
        assert_eq!(probs.len(), 1);
        assert_eq!(probs[0].field, "provider");
        assert_eq!(probs[0].line, Some(4));
        assert!(!probs[0].warning);
        let shown = probs[0].to_string();
        assert!(
            shown.starts_with("cyberwave.yml:4: error: provider: unknown field"),
            "{shown}"
        );
    }

    #[test]
    fn lenient_turns_unknown_keys_into_warnings() {
        let (m, probs) = parse(Path::new("c.yml"), "inferense: x\nserver_port: 1\n", true);
        assert!(m.is_some());
        assert_eq!(probs.len(), 2);
        assert!(probs.iter().all(|p| p.warning));
        assert!(
            probs[0].message.contains("did you mean `inference`"),
            "{}",
            probs[0].message
        );
    }

    #[test]
    fn lenient_still_fails_on_wrong_types() {
        let (m, probs) = parse(Path::new("c.yml"), "heartbeat_interval: soon\n", true);
        assert!(m.is_none());
        assert_eq!(probs[0].field, "heartbeat_interval");
        assert!(
            probs[0].message.contains("greater than 0"),
            "{}",
            probs[0].message
        );
        assert!(
            probs[0].message.contains("\"soon\""),
            "{}",
            probs[0].message
        );
    }

    #[test]
    fn rejects_bad_values_and_reports_them_all() {
        let (m, probs) = p(
            "cyberwave:\n  heartbeat_interval: 0\n  mqtt_port: 70000\n  upload_results: maybe\n  max_concurrent_workloads: -1\n  inference: [a]\n",
        );
        assert!(m.is_none());
        let fields: Vec<_> = probs.iter().map(|p| (p.field.as_str(), p.line)).collect();
        assert_eq!(
            fields,
            vec![
                ("heartbeat_interval", Some(2)),
                ("mqtt_port", Some(3)),
                ("upload_results", Some(4)),
                ("max_concurrent_workloads", Some(5)),
                ("inference", Some(6))
            ]
        );
        assert!(probs[1].message.contains("1 to 65535"));
        let (_, neg) = p("heartbeat_interval: -3\n");
        assert_eq!(neg.len(), 1);
    }

    #[test]
    fn yaml_syntax_error_has_a_line() {
        let (m, probs) = p("a: b\n  c: : d\n");
        assert!(m.is_none());
        assert_eq!(probs[0].field, "yaml");
        assert!(probs[0].line.is_some());
    }

    #[test]
    fn wrapper_must_hold_a_mapping_and_top_level_extras_are_flagged() {
        let (m, probs) = p("cyberwave: 3\n");
        assert!(m.is_none());
        assert_eq!(probs[0].line, Some(1));
        let (m, probs) = p("cyberwave:\n  inference: x\nstray: 1\n");
        assert!(m.is_none());
        assert_eq!((probs[0].field.as_str(), probs[0].line), ("stray", Some(3)));
    }

    #[test]
    fn runtime_needs_model_or_inference() {
        assert!(p("runtime: vllm\n").0.is_none());
        assert!(p("runtime: vllm\nmodel: m\n").0.is_some());
    }

    #[test]
    fn readme_front_matter_keeps_readme_line_numbers() {
        let fm = front_matter("# Title\n---\ninference: x\nbogus: 1\n---\nbody\n").unwrap();
        let (_, probs) = parse(Path::new("README.md"), &fm, false);
        assert_eq!(probs[0].line, Some(4));
        assert!(front_matter("no front matter").is_none());
    }

    #[test]
    fn locate_prefers_yml_then_readme() {
        let dir = std::env::temp_dir().join(format!("cw-loc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(locate(None, &dir).unwrap().is_none());
        std::fs::write(dir.join("README.md"), "---\ninference: r\n---\n").unwrap();
        let (path, _) = locate(None, &dir).unwrap().unwrap();
        assert!(path.ends_with("README.md"));
        std::fs::write(dir.join("cyberwave.yml"), "inference: y\n").unwrap();
        let (path, _) = locate(None, &dir).unwrap().unwrap();
        assert!(path.ends_with("cyberwave.yml"));
        assert!(locate(Some(&dir.join("nope/x.yml")), &dir).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn front_matter_keeps_line_numbers_and_needs_two_fences() {
        assert_eq!(
            front_matter("# T\n---\na: 1\nb: 2\n---\nrest\n").as_deref(),
            Some("\n\na: 1\nb: 2")
        );
        assert_eq!(front_matter("---\n---").as_deref(), Some("\n"));
        assert_eq!(front_matter("---\na: 1\n"), None);
        assert_eq!(front_matter("---"), None);
        assert_eq!(front_matter(""), None);
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("éa", "a"), 1);
    }
}
