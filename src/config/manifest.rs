//! `cyberwave.yml`, read twice over in one pass (decisions D22, D23):
//!
//! * the **platform's verdict**, for `validate`: the file as the Cyberwave SDK's validator
//!   (`cyberwave.manifest.validate_manifest`, PyYAML + pydantic in lax mode) judges it, strict or
//!   `--lenient`, plus two deliberate refusals (a port outside 1–65535, a heartbeat ≤ 0) and the
//!   node's own rules for its `cloud_node:` section, which the platform never reads;
//! * what **`start`** can use: every problem the node can live with (an unknown key, a value
//!   the platform refuses but the node can use) is a warning for `start`; only a value the node
//!   needs and cannot use stops it.
//!
//! YAML is read with YAML 1.1 scalars, as PyYAML does (see [`super::yaml11`]). Settings sit under
//! `cyberwave:` (or the legacy `cyberwave-cloud-node:`, or flat at the root); the node-only
//! settings under a top-level `cloud_node:` beside it, or, for compatibility, inside `cyberwave:`.
//!
//! [`parse_manifest_text`] is the pure entry point (text in, verdict out), also the fuzz target.

use std::path::{Path, PathBuf};
use std::rc::Rc;

use super::yaml11::{self, Node, Scalar, Value};

/// One problem found in a manifest.
#[derive(Debug, Clone, PartialEq)]
pub struct Problem {
    pub file: PathBuf,
    pub line: Option<usize>,
    pub field: String,
    pub message: String,
    /// Not an error for `validate` (the platform accepts the file).
    pub warning: bool,
    /// `start` still runs with this problem (it ignores the key or uses the value).
    pub start_ok: bool,
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = if self.warning { "warning" } else { "error" };
        match self.line {
            Some(l) => write!(f, "{}:{l}: ", self.file.display())?,
            None => write!(f, "{}: ", self.file.display())?,
        }
        write!(f, "{kind}: {}: {}", self.field, self.message)?;
        if !self.warning && self.start_ok {
            write!(f, " [`start` would still run this file]")?;
        }
        Ok(())
    }
}

/// The values a manifest can set. `None` means "not in the file" (or not usable).
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
    /// GPUs each workload gets when its params do not say (D36).
    pub gpus_per_workload: Option<u32>,
    /// Parsed and stored.
    pub max_result_bytes: Option<u64>,
    /// D46.3: the user (name or uid) workloads run as.
    pub workload_user: Option<String>,
    /// D59: `services: stop` (`Some(false)`) clears what a workload puts in a session of its
    /// own when it ends; `keep` (the default) leaves it running, tracked as a service.
    pub keep_services: Option<bool>,
    /// D60: `install_user: node` runs the install script as the node's user even with a
    /// `workload_user` (`Some(true)`); `workload_user` (the default) runs it as that user.
    pub install_as_node: Option<bool>,
    /// For each key the node took from the file, the section it came from (`cyberwave`,
    /// `cyberwave-cloud-node`, `cloud_node` or `root`); `config` shows it.
    pub sections: Vec<(String, String)>,
}

impl Manifest {
    /// The section a key was read from.
    pub fn section_of(&self, key: &str) -> Option<&str> {
        self.sections
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, s)| s.as_str())
    }
}

/// The outcome of reading a manifest.
#[derive(Debug, Clone, PartialEq)]
pub struct Checked {
    /// What `start` uses; `None` when a value it needs is unusable (or the file unreadable).
    pub manifest: Option<Manifest>,
    /// Every problem, in line order.
    pub problems: Vec<Problem>,
}

impl Checked {
    /// `validate`'s verdict: no errors.
    pub fn valid(&self) -> bool {
        self.problems.iter().all(|p| p.warning)
    }
}

/// The platform's field types (`ManifestSchema`), as pydantic checks them in lax mode.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    /// `str` with a default: `null` refused.
    Str,
    OptStr,
    OptStrList,
    /// `list[str] | None`, a bare string becoming a one-element list.
    Input,
    Bool,
    OptBool,
    Version,
    /// `int` (heartbeat_interval); null refused.
    Int,
    OptInt,
    Resources,
}

/// The SDK's `ManifestSchema` fields.
const PLATFORM_FIELDS: &[(&str, Kind)] = &[
    ("version", Kind::Version),
    ("name", Kind::OptStr),
    ("install", Kind::OptStr),
    ("install_script", Kind::OptStr),
    ("requirements", Kind::OptStrList),
    ("models", Kind::OptStrList),
    ("inference", Kind::OptStr),
    ("training", Kind::OptStr),
    ("simulate", Kind::OptStr),
    ("workers", Kind::OptStrList),
    ("input", Kind::Input),
    ("gpu", Kind::Bool),
    ("runtime", Kind::OptStr),
    ("model", Kind::OptStr),
    ("profile_slug", Kind::Str),
    ("heartbeat_interval", Kind::Int),
    ("upload_results", Kind::Bool),
    ("results_folder", Kind::Str),
    ("resources", Kind::Resources),
    ("mqtt_host", Kind::OptStr),
    ("mqtt_port", Kind::OptInt),
    ("mqtt_use_tls", Kind::OptBool),
    ("mqtt_tls_ca_certs", Kind::OptStr),
    ("mqtt_username", Kind::OptStr),
    ("mqtt_password", Kind::OptStr),
];

/// Platform fields the node acts on; a value it cannot use stops `start`.
const NODE_USES: &[&str] = &[
    "install",
    "install_script",
    "inference",
    "training",
    "simulate",
    "profile_slug",
    "heartbeat_interval",
    "upload_results",
    "results_folder",
    "mqtt_host",
    "mqtt_port",
    "mqtt_use_tls",
    "mqtt_tls_ca_certs",
    "mqtt_username",
    "mqtt_password",
];

/// The node's own settings (D23): under `cloud_node:`; still read inside `cyberwave:`.
#[derive(Clone, Copy, PartialEq)]
enum NodeKind {
    /// A whole number ≥ the bound, at most the maximum.
    Whole(u64, u64),
    Seconds,
    OnOff,
    Text,
    /// One of these words.
    Choice(&'static [&'static str]),
}

const NODE_FIELDS: &[(&str, NodeKind)] = &[
    (
        "max_concurrent_workloads",
        NodeKind::Whole(1, u32::MAX as u64),
    ),
    ("max_runtime_seconds", NodeKind::Seconds),
    ("workflow_reporting", NodeKind::OnOff),
    ("min_free_disk_mb", NodeKind::Whole(0, u64::MAX)),
    ("max_log_bytes", NodeKind::Whole(1, u64::MAX)),
    ("log_retention_days", NodeKind::Whole(0, u64::MAX)),
    ("gpus_per_workload", NodeKind::Whole(0, u32::MAX as u64)),
    ("max_result_bytes", NodeKind::Whole(1, u64::MAX)),
    ("environment_uuid", NodeKind::Text),
    ("workload_user", NodeKind::Text),
    ("services", NodeKind::Choice(&["keep", "stop"])),
    ("install_user", NodeKind::Choice(&["node", "workload_user"])),
];

pub const WRAPPER_NEW: &str = "cyberwave";
pub const WRAPPER_LEGACY: &str = "cyberwave-cloud-node";
pub const NODE_SECTION: &str = "cloud_node";
/// Larger files are refused before parsing (a manifest is a few hundred bytes).
pub const MAX_MANIFEST_BYTES: usize = 4 << 20;
/// Longest heartbeat the node accepts (seconds).
const MAX_HEARTBEAT_SECONDS: f64 = u32::MAX as f64;

/// Why no manifest text could be had.
#[derive(Debug)]
pub enum LocateError {
    /// Not UTF-8: the line and byte offset of the first invalid byte, and whether the file
    /// starts with a UTF-16 byte-order mark.
    NotUtf8 {
        path: PathBuf,
        line: usize,
        at: usize,
        utf16: bool,
    },
    /// Larger than [`MAX_MANIFEST_BYTES`] (the error names both sizes).
    TooLarge(PathBuf, std::io::Error),
    /// It exists and cannot be read.
    Unreadable(PathBuf, std::io::Error),
    /// The explicit path does not exist, and no README.md with front matter is beside it.
    Missing(PathBuf),
}

impl std::fmt::Display for LocateError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LocateError::NotUtf8 {
                path,
                line,
                at,
                utf16,
            } => {
                let hint = if *utf16 {
                    "; it starts with a UTF-16 byte-order mark: save it as UTF-8"
                } else {
                    ""
                };
                write!(
                    f,
                    "{}:{line}: error: yaml: the file is not UTF-8 text (invalid byte at offset {at}){hint}",
                    path.display()
                )
            }
            LocateError::TooLarge(path, e) => write!(f, "{}:1: error: yaml: {e}", path.display()),
            LocateError::Unreadable(path, e) => write!(f, "cannot read {}: {e}", path.display()),
            LocateError::Missing(p) => write!(
                f,
                "config file {} does not exist (and no README.md with front matter beside it)",
                p.display()
            ),
        }
    }
}

impl std::error::Error for LocateError {}

/// Which file to read: an explicit path (its README.md front matter when it does not exist),
/// else `./cyberwave.yml`, else `./README.md` front matter. `Ok(None)`: no manifest at all.
pub fn locate(
    explicit: Option<&Path>,
    cwd: &Path,
) -> Result<Option<(PathBuf, String)>, LocateError> {
    let (yml, readme) = match explicit {
        Some(p) => (
            p.to_path_buf(),
            p.parent().unwrap_or(Path::new(".")).join("README.md"),
        ),
        None => (cwd.join("cyberwave.yml"), cwd.join("README.md")),
    };
    match read_bounded(&yml) {
        Ok(bytes) => {
            return String::from_utf8(bytes)
                .map(|t| Some((yml.clone(), t)))
                .map_err(|e| {
                    let at = e.utf8_error().valid_up_to();
                    let line = e
                        .as_bytes()
                        .get(..at)
                        .map(|b| b.iter().filter(|c| **c == b'\n').count())
                        .unwrap_or(0)
                        .saturating_add(1);
                    let utf16 = e.as_bytes().starts_with(&[0xFF, 0xFE])
                        || e.as_bytes().starts_with(&[0xFE, 0xFF]);
                    LocateError::NotUtf8 {
                        path: yml.clone(),
                        line,
                        at,
                        utf16,
                    }
                });
        }
        Err(e) if e.kind() == std::io::ErrorKind::FileTooLarge => {
            return Err(LocateError::TooLarge(yml, e))
        }
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(LocateError::Unreadable(yml, e))
        }
        Err(_) => {}
    }
    let readme_text = read_bounded(&readme).map(String::from_utf8);
    if let Ok(Ok(text)) = readme_text {
        if let Some(front) = front_matter(strip_bom(&text)) {
            return Ok(Some((readme, front)));
        }
    }
    match explicit {
        Some(p) => Err(LocateError::Missing(p.to_path_buf())),
        None => Ok(None),
    }
}

/// Reads a file of at most [`MAX_MANIFEST_BYTES`] (D49); a larger one is refused, naming its
/// size and the bound, without reading it (`ErrorKind::FileTooLarge`).
fn read_bounded(path: &Path) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let file = std::fs::File::open(path)?;
    let too_large = |size: u64| {
        std::io::Error::new(
            std::io::ErrorKind::FileTooLarge,
            format!(
                "the file is {size} bytes; a manifest may be at most {MAX_MANIFEST_BYTES} (4 MiB)"
            ),
        )
    };
    let bound = u64::try_from(MAX_MANIFEST_BYTES).unwrap_or(u64::MAX);
    let declared = file.metadata()?.len();
    if declared > bound {
        return Err(too_large(declared));
    }
    // A file that grows while read (or a pipe, whose length reads 0) is bounded too.
    let mut bytes = Vec::new();
    file.take(bound.saturating_add(1)).read_to_end(&mut bytes)?;
    if bytes.len() > MAX_MANIFEST_BYTES {
        return Err(too_large(
            declared.max(u64::try_from(bytes.len()).unwrap_or(u64::MAX)),
        ));
    }
    Ok(bytes)
}

/// Text without its leading UTF-8 byte-order mark, which PyYAML skips too (D49).
fn strip_bom(text: &str) -> &str {
    text.strip_prefix('\u{FEFF}').unwrap_or(text)
}

/// The YAML between the first two `---` lines of a README, with blank lines in front so that
/// line numbers in problems point at the README's own lines.
fn front_matter(text: &str) -> Option<String> {
    let lines: Vec<&str> = text.lines().collect();
    let first = lines.iter().position(|l| l.trim_end() == "---")?;
    let body = lines.get(first.checked_add(1)?..)?;
    let len = body.iter().position(|l| l.trim_end() == "---")?;
    let mut out = "\n".repeat(first.checked_add(1)?);
    out.push_str(&body.get(..len)?.join("\n"));
    Some(out)
}

/// The pure entry point: manifest text in, what `start` can use and every problem out (file
/// names in problems read `cyberwave.yml`). Never panics, whatever the text.
pub fn parse_manifest_text(text: &str, lenient: bool) -> Checked {
    check(Path::new("cyberwave.yml"), text, lenient)
}

/// `validate`'s view: the manifest only when the file has no error, and every problem.
pub fn parse(path: &Path, text: &str, lenient: bool) -> (Option<Manifest>, Vec<Problem>) {
    let c = check(path, text, lenient);
    let valid = c.valid();
    (c.manifest.filter(|_| valid), c.problems)
}

struct Ctx<'a> {
    path: &'a Path,
    lenient: bool,
    problems: Vec<Problem>,
    /// A value `start` needs is unusable.
    blocked: bool,
}

impl Ctx<'_> {
    fn push(&mut self, line: usize, field: &str, message: String, warning: bool, start_ok: bool) {
        if !start_ok {
            self.blocked = true;
        }
        self.problems.push(Problem {
            file: self.path.to_path_buf(),
            line: Some(line),
            field: field.to_string(),
            message,
            warning,
            start_ok,
        });
    }
    fn warn(&mut self, line: usize, field: &str, message: String) {
        self.push(line, field, message, true, true);
    }
    /// The platform refuses it; `start` carries on.
    fn platform(&mut self, line: usize, field: &str, message: String) {
        self.push(line, field, message, false, true);
    }
    /// Refused by both.
    fn fatal(&mut self, line: usize, field: &str, message: String) {
        self.push(line, field, message, false, false);
    }
}

/// Reads manifest text; `path` only labels the problems.
pub fn check(path: &Path, text: &str, lenient: bool) -> Checked {
    let mut cx = Ctx {
        path,
        lenient,
        problems: Vec::new(),
        blocked: false,
    };
    let m = read(&mut cx, text);
    let mut problems = cx.problems;
    problems.sort_by_key(|p| p.line.unwrap_or(0));
    Checked {
        manifest: if cx.blocked { None } else { m },
        problems,
    }
}

/// The root of manifest text, once it is known to be a mapping.
enum Top {
    /// Nothing to read: an empty file, or a falsy scalar (read as empty, as the platform does).
    Empty,
    Map(Rc<Node>),
}

fn read(cx: &mut Ctx, text: &str) -> Option<Manifest> {
    let mut m = Manifest {
        path: cx.path.to_path_buf(),
        ..Default::default()
    };
    let root = match top(cx, text)? {
        Top::Empty => return Some(m),
        Top::Map(root) => root,
    };
    let Value::Map(entries) = &root.value else {
        return Some(m);
    };
    let wrapper = [WRAPPER_NEW, WRAPPER_LEGACY]
        .into_iter()
        .find(|w| root.get(w).is_some());
    m.wrapper = wrapper.map(String::from);
    let inner = match wrapper {
        Some(w) => wrapper_entries(cx, &root, entries, w),
        None => entries.as_slice(),
    };
    if let Some(w) = wrapper {
        beside_wrapper(cx, entries, w);
    }
    let section = wrapper.unwrap_or("root");
    let node_from_wrapper = read_inner(cx, &mut m, inner, wrapper);
    if wrapper.is_some() && cx.lenient {
        mixed_unknown_keys(cx, inner);
    }
    cross_field_rule(cx, inner);
    // `install` wins over `install_script` whatever their order.
    if let Some(i) = inner
        .iter()
        .find(|(k, _)| k.as_str() == Some("install"))
        .and_then(|(_, v)| usable_text(v))
    {
        m.install = Some(i);
    }
    // The node's own section, then the node settings found inside the wrapper.
    let from_section = node_section(cx, &mut m, entries);
    for (key, k, v) in node_from_wrapper {
        if from_section.contains(&key) {
            cx.warn(
                k.line,
                &key,
                format!("ignored: `{NODE_SECTION}:` sets it too, and wins"),
            );
            continue;
        }
        node_field(cx, &mut m, &key, k.line, &v);
        m.sections.push((key, section.to_string()));
    }
    Some(m)
}

/// Loads the YAML (bounded in size) and checks that it is a mapping; `None` when it cannot be
/// read at all.
fn top(cx: &mut Ctx, text: &str) -> Option<Top> {
    if text.len() > MAX_MANIFEST_BYTES {
        cx.fatal(
            1,
            "yaml",
            format!(
                "the file is {} bytes; a manifest may be at most {MAX_MANIFEST_BYTES} (4 MiB)",
                text.len()
            ),
        );
        return None;
    }
    let (root, notes) = match yaml11::load(strip_bom(text)) {
        Ok(x) => x,
        Err(f) => {
            cx.fatal(f.line, "yaml", f.message);
            return None;
        }
    };
    for n in notes {
        if n.platform_error {
            cx.platform(
                n.line,
                "yaml",
                format!("the platform cannot load this: {}", n.message),
            );
        } else {
            cx.warn(n.line, "yaml", n.message);
        }
    }
    let Some(root) = root else {
        return Some(Top::Empty);
    };
    match &root.value {
        Value::Map(_) => Some(Top::Map(root)),
        _ if root.is_falsy() => {
            if !root.is_null() {
                cx.warn(
                    root.line,
                    "structure",
                    format!(
                        "the file holds {}; read as an empty manifest, as the platform does",
                        root.describe()
                    ),
                );
            }
            Some(Top::Empty)
        }
        _ => {
            cx.fatal(
                root.line,
                "structure",
                format!(
                    "the file must be a mapping of settings (`cyberwave:` and its keys), found {} (the platform's validator crashes on it)",
                    root.describe()
                ),
            );
            None
        }
    }
}

/// The wrapper's own entries; one that is not a mapping reads as empty, as on the platform.
fn wrapper_entries<'a>(
    cx: &mut Ctx,
    root: &'a Node,
    entries: &[(Rc<Node>, Rc<Node>)],
    w: &str,
) -> &'a [(Rc<Node>, Rc<Node>)] {
    let Some(node) = root.get(w) else {
        return &[];
    };
    match &node.value {
        Value::Map(e) => e.as_slice(),
        _ => {
            if !node.is_null() {
                let line = key_line(entries, w);
                cx.warn(
                    line,
                    w,
                    format!(
                        "holds {}, not a mapping; read as empty, as the platform does",
                        node.describe()
                    ),
                );
            }
            &[]
        }
    }
}

/// Top level beside the wrapper: the platform ignores everything but the wrapper.
fn beside_wrapper(cx: &mut Ctx, entries: &[(Rc<Node>, Rc<Node>)], w: &str) {
    for (k, _) in entries.iter() {
        let name = k.as_str().unwrap_or(&k.text);
        if k.as_str() == Some(w) || k.as_str() == Some(NODE_SECTION) {
            continue;
        }
        // Anything else beside the wrapper is ignored, silently as on the platform (it is
        // where anchors for `<<` live), unless it looks like a misplaced setting.
        let known = |n: &str| {
            PLATFORM_FIELDS.iter().any(|(f, _)| *f == n) || NODE_FIELDS.iter().any(|(f, _)| *f == n)
        };
        let why = if k.as_str() == Some(WRAPPER_LEGACY) {
            format!("ignored: `{w}:` is also present and wins (as on the platform)")
        } else if known(name) {
            format!("ignored: a setting beside `{w}:` (the platform ignores it too); settings belong under `{w}:`, node settings under `{NODE_SECTION}:`")
        } else {
            continue;
        };
        cx.warn(k.line, name, why);
    }
}

/// Reads the wrapper's keys (or the root's, without one): the platform's fields into `m`; the
/// node settings found there are returned, to be read after the node's own section.
fn read_inner(
    cx: &mut Ctx,
    m: &mut Manifest,
    inner: &[(Rc<Node>, Rc<Node>)],
    wrapper: Option<&str>,
) -> Vec<(String, Rc<Node>, Rc<Node>)> {
    let section = wrapper.unwrap_or("root");
    let mut node_from_wrapper = Vec::new();
    for (k, v) in inner.iter() {
        let Some(key) = k.as_str() else {
            unknown_key(cx, k, wrapper);
            continue;
        };
        if let Some(&(_, kind)) = PLATFORM_FIELDS.iter().find(|(n, _)| *n == key) {
            platform_field(cx, m, key, kind, k.line, v);
            m.sections.push((key.to_string(), section.to_string()));
        } else if NODE_FIELDS.iter().any(|(n, _)| *n == key)
            || (wrapper.is_none() && key == NODE_SECTION)
        {
            if wrapper.is_some() && key != NODE_SECTION {
                let msg = format!("a node setting, which the platform's validator refuses inside `{section}:`; move it to a top-level `{NODE_SECTION}:` mapping (the node still reads it here)");
                if cx.lenient {
                    cx.warn(
                        k.line,
                        key,
                        format!("{msg}; the platform ignores it (--lenient)"),
                    );
                } else {
                    cx.platform(k.line, key, msg);
                }
            } else {
                cx.platform(k.line, key, format!("the platform refuses a file without `{WRAPPER_NEW}:` whose keys it does not know; put the settings under `{WRAPPER_NEW}:` and node settings under a top-level `{NODE_SECTION}:` (the node still reads it)"));
            }
            if key != NODE_SECTION {
                node_from_wrapper.push((key.to_string(), Rc::clone(k), Rc::clone(v)));
            }
        } else {
            unknown_key(cx, k, wrapper);
        }
    }
    node_from_wrapper
}

/// With --lenient the platform sorts the unknown keys to list them: keys of types Python
/// cannot compare (a string and a number, `null` and anything) crash its validator.
fn mixed_unknown_keys(cx: &mut Ctx, inner: &[(Rc<Node>, Rc<Node>)]) {
    let class = |k: &Node| match k.scalar() {
        Some(Scalar::Str(_)) => 0u8,
        Some(Scalar::Bool(_) | Scalar::Int(_) | Scalar::Float(_)) => 1,
        Some(Scalar::Null) => 2,
        Some(Scalar::Timestamp) => 3,
        _ => 4,
    };
    let unknown: Vec<&Rc<Node>> = inner
        .iter()
        .map(|(k, _)| k)
        .filter(|k| {
            k.as_str()
                .is_none_or(|n| !PLATFORM_FIELDS.iter().any(|(f, _)| *f == n))
        })
        .collect();
    let first = unknown.first().map(|k| class(k));
    if let Some(odd) = unknown.iter().find(|k| Some(class(k)) != first) {
        cx.platform(
            odd.line,
            &odd.text,
            "unknown keys of mixed types (a string and a number or null): the platform's validator crashes on them with --lenient; the node ignores them".into(),
        );
    }
}

/// The platform's cross-field rule, checked on the values it would have accepted.
fn cross_field_rule(cx: &mut Ctx, inner: &[(Rc<Node>, Rc<Node>)]) {
    let truthy = |key: &str| {
        inner
            .iter()
            .find(|(k, _)| k.as_str() == Some(key))
            .and_then(|(_, v)| v.as_str())
            .is_some_and(|s| !s.is_empty())
    };
    if truthy("runtime") && !truthy("model") && !truthy("inference") {
        let line = key_line(inner, "runtime");
        cx.platform(
            line,
            "runtime",
            "`runtime` needs `model` or `inference` as well (the node does not use `runtime`)"
                .into(),
        );
    }
}

/// The node's own section (`cloud_node:`); returns the keys it set.
fn node_section(cx: &mut Ctx, m: &mut Manifest, entries: &[(Rc<Node>, Rc<Node>)]) -> Vec<String> {
    let mut from_section: Vec<String> = Vec::new();
    let Some((sk, sv)) = entries
        .iter()
        .find(|(k, _)| k.as_str() == Some(NODE_SECTION))
    else {
        return from_section;
    };
    match &sv.value {
        Value::Map(e) => {
            for (k, v) in e.iter() {
                let key = k.as_str().unwrap_or(&k.text).to_string();
                if NODE_FIELDS.iter().any(|(n, _)| *n == key) {
                    node_field(cx, m, &key, k.line, v);
                    m.sections.push((key.clone(), NODE_SECTION.to_string()));
                    from_section.push(key);
                } else {
                    let hint = closest(&key, true)
                        .map(|s| format!(" (did you mean `{s}`?)"))
                        .unwrap_or_default();
                    let msg = format!("unknown node setting{hint}; ignored");
                    if cx.lenient {
                        cx.warn(k.line, &key, msg);
                    } else {
                        cx.platform(k.line, &key, msg);
                    }
                }
            }
        }
        _ if sv.is_null() => {}
        _ => cx.platform(
            sk.line,
            NODE_SECTION,
            format!(
                "expected a mapping of node settings, found {}; ignored",
                sv.describe()
            ),
        ),
    }
    from_section
}

fn key_line(entries: &[(Rc<Node>, Rc<Node>)], key: &str) -> usize {
    entries
        .iter()
        .find(|(k, _)| k.as_str() == Some(key))
        .map(|(k, _)| k.line)
        .unwrap_or(1)
}

fn unknown_key(cx: &mut Ctx, k: &Node, wrapper: Option<&str>) {
    let name = match k.as_str() {
        Some(s) => s.to_string(),
        None => k.text.clone(),
    };
    let hint = k
        .as_str()
        .and_then(|s| closest(s, false))
        .map(|s| format!(" (did you mean `{s}`?)"))
        .unwrap_or_default();
    let key_kind = if k.as_str().is_some() {
        String::new()
    } else {
        format!(" (YAML 1.1 reads this key as {})", k.describe())
    };
    match wrapper {
        Some(_) if cx.lenient => cx.warn(
            k.line,
            &name,
            format!("unknown field{hint}{key_kind}; ignored (--lenient)"),
        ),
        Some(_) => cx.platform(
            k.line,
            &name,
            format!("unknown field{hint}{key_kind}; the node ignores it"),
        ),
        None => cx.platform(
            k.line,
            &name,
            format!("unknown field{hint}{key_kind}: the platform refuses a file without `{WRAPPER_NEW}:` whose keys it does not know (even with --lenient); the node ignores it"),
        ),
    }
}

/// pydantic's lax `bool`.
fn lax_bool(v: &Node) -> Option<bool> {
    match v.scalar()? {
        Scalar::Bool(b) => Some(*b),
        Scalar::Int(Some(0)) => Some(false),
        Scalar::Int(Some(1)) => Some(true),
        Scalar::Float(f) if *f == 0.0 => Some(false),
        Scalar::Float(f) if *f == 1.0 => Some(true),
        Scalar::Str(s) => match s.to_ascii_lowercase().as_str() {
            "0" | "off" | "f" | "false" | "n" | "no" => Some(false),
            "1" | "on" | "t" | "true" | "y" | "yes" => Some(true),
            _ => None,
        },
        _ => None,
    }
}

enum LaxInt {
    Int(i128),
    /// A valid int for pydantic that no setting can use.
    Huge,
    /// A number with a fraction (pydantic refuses it for `int`).
    Fraction,
    No,
}

/// pydantic's lax `int`.
fn lax_int(v: &Node) -> LaxInt {
    match v.scalar() {
        Some(Scalar::Int(Some(n))) => LaxInt::Int(*n),
        Some(Scalar::Int(None)) => LaxInt::Huge,
        Some(Scalar::Bool(b)) => LaxInt::Int(i128::from(*b)),
        Some(Scalar::Float(f)) => float_to_int(*f),
        Some(Scalar::Str(s)) => str_to_int(s),
        _ => LaxInt::No,
    }
}

fn float_to_int(f: f64) -> LaxInt {
    if !f.is_finite() {
        LaxInt::No
    } else if f.fract() != 0.0 {
        LaxInt::Fraction
    } else if f.abs() >= 9.2e18 {
        LaxInt::No
    } else {
        // Whole and within ±2^63: exact.
        #[allow(clippy::cast_possible_truncation)] // checked above
        LaxInt::Int(f as i128)
    }
}

/// `"30"`, `" 30 "`, `"1_000"`, `"+5"`, `"30.00"`: what pydantic takes as an int.
fn str_to_int(s: &str) -> LaxInt {
    let t = s.trim();
    let (neg, body) = match t.strip_prefix('-') {
        Some(r) => (true, r),
        None => (false, t.strip_prefix('+').unwrap_or(t)),
    };
    let (whole, frac) = match body.split_once('.') {
        Some((w, f)) => (w, Some(f)),
        None => (body, None),
    };
    if frac.is_some_and(|f| f.is_empty() || !f.chars().all(|c| c == '0')) {
        return match lax_float_str(s) {
            Some(f) if f.is_finite() => LaxInt::Fraction,
            _ => LaxInt::No,
        };
    }
    if whole.is_empty()
        || whole.starts_with('_')
        || whole.ends_with('_')
        || whole.contains("__")
        || !whole.chars().all(|c| c.is_ascii_digit() || c == '_')
    {
        return LaxInt::No;
    }
    let digits: String = whole.chars().filter(|c| *c != '_').collect();
    match digits.parse::<i128>() {
        Ok(n) => LaxInt::Int(if neg { n.saturating_neg() } else { n }),
        Err(_) => LaxInt::Huge,
    }
}

/// Python's `float()` on a string, near enough: underscores between digits, `inf`, `nan`.
fn lax_float_str(s: &str) -> Option<f64> {
    let t = s.trim();
    if t.starts_with('_') || t.ends_with('_') || t.contains("__") {
        return None;
    }
    t.replace('_', "").parse::<f64>().ok()
}

fn lax_float(v: &Node) -> Option<f64> {
    match v.scalar()? {
        Scalar::Int(Some(n)) => Some(*n as f64),
        Scalar::Bool(b) => Some(f64::from(u8::from(*b))),
        Scalar::Float(f) => Some(*f),
        Scalar::Str(s) => lax_float_str(s),
        _ => None,
    }
}

/// A string setting the node can use: a string as it is, a number or boolean as written,
/// `None` for null. `Err` for a list, a mapping or an exotic value.
fn usable_text(v: &Node) -> Option<String> {
    match &v.value {
        Value::Scalar(Scalar::Str(s)) => Some(s.clone()),
        Value::Scalar(Scalar::Bool(_) | Scalar::Int(_) | Scalar::Float(_) | Scalar::Timestamp) => {
            Some(v.text.clone())
        }
        _ => None,
    }
}

fn is_str_list(v: &Node) -> bool {
    match &v.value {
        Value::Seq(items) => items.iter().all(|i| i.as_str().is_some()),
        _ => false,
    }
}

/// Checks one platform field the way pydantic would, and takes what the node uses.
fn platform_field(cx: &mut Ctx, m: &mut Manifest, key: &str, kind: Kind, line: usize, v: &Node) {
    let uses = NODE_USES.contains(&key);
    // 1. The platform's verdict.
    let refusal = platform_verdict(kind, v);
    // 2. What the node takes, and whether it can.
    let unusable = if uses && !v.is_null() {
        take_platform_value(m, key, v, &refusal)
    } else {
        if key == "name" {
            m.name = v.as_str().map(String::from);
        }
        None
    };
    match (refusal, unusable) {
        (_, Some(why)) => cx.fatal(line, key, why),
        (Some(why), None) => {
            let tail = if v.is_null() {
                ""
            } else if uses && key == "heartbeat_interval" {
                " — the node uses it as it is"
            } else if uses {
                " — the node uses the value as written"
            } else if !uses {
                " — the node does not use this key"
            } else {
                ""
            };
            cx.platform(line, key, format!("{why}{tail}"));
        }
        (None, None) => {}
    }
    // D63: a `{body}` in quotes gets the params file's path as text.
    if matches!(key, "inference" | "simulate" | "training") {
        for w in v
            .as_str()
            .map(super::template::warnings)
            .unwrap_or_default()
        {
            cx.warn(line, key, w);
        }
    }
}

/// Why the platform (pydantic) refuses `v` as a field of this kind, if it does.
fn platform_verdict(kind: Kind, v: &Node) -> Option<String> {
    let got = v.describe();
    match kind {
        _ if v.is_null() => match kind {
            Kind::Str | Kind::Bool | Kind::Int | Kind::Version => Some(
                "an explicit null, which the platform refuses here (leave the key out for the default); the node treats it as unset".into(),
            ),
            _ => None,
        },
        Kind::Str | Kind::OptStr => v
            .as_str()
            .is_none()
            .then(|| format!("expected a string, got {got} (quote it: YAML 1.1 reads it as another type)")),
        Kind::Version => match v.as_str() {
            Some("1") => None,
            Some(other) => Some(format!("unsupported manifest version {other:?}; only \"1\" is supported")),
            None => Some(format!("expected the string \"1\", got {got} (write `version: \"1\"`)")),
        },
        Kind::OptStrList => (!is_str_list(v)).then(|| format!("expected a list of strings, got {got}")),
        Kind::Input => (v.as_str().is_none() && !is_str_list(v))
            .then(|| format!("expected a string or a list of strings, got {got}")),
        Kind::Bool | Kind::OptBool => lax_bool(v).is_none().then(|| {
            format!("expected a boolean (true/false, yes/no, on/off, 1/0, y/n, t/f), got {got}")
        }),
        Kind::Int | Kind::OptInt => match lax_int(v) {
            LaxInt::Int(_) | LaxInt::Huge => None,
            LaxInt::Fraction => Some(format!("expected a whole number, got {got}")),
            LaxInt::No => Some(format!("expected a whole number, got {got}")),
        },
        Kind::Resources => match &v.value {
            Value::Map(e) => {
                let mut bad = None;
                for (rk, rv) in e.iter() {
                    match rk.as_str() {
                        Some("memory") if !rv.is_null() && rv.as_str().is_none() => {
                            bad = Some(format!("`resources.memory`: expected a string, got {}", rv.describe()));
                        }
                        Some("cpus") if !rv.is_null() && lax_float(rv).is_none() => {
                            bad = Some(format!("`resources.cpus`: expected a number, got {}", rv.describe()));
                        }
                        _ => {}
                    }
                }
                bad
            }
            _ => Some(format!("expected a mapping with `memory` and `cpus`, got {got}")),
        },
    }
}

/// Takes a platform field the node uses into `m`; `Some(why)` when the node cannot use it
/// (`refusal` is the platform's verdict, which a switch shares).
fn take_platform_value(
    m: &mut Manifest,
    key: &str,
    v: &Node,
    refusal: &Option<String>,
) -> Option<String> {
    let got = v.describe();
    let mut unusable: Option<String> = None;
    match key {
            "heartbeat_interval" => match lax_float(v).filter(|f| !f.is_nan()) {
                Some(f) if f > 0.0 && f <= MAX_HEARTBEAT_SECONDS => m.heartbeat_interval = Some(f),
                Some(_) => {
                    unusable = Some(format!(
                        "expected a number of seconds greater than 0 (at most {MAX_HEARTBEAT_SECONDS}), got {got}: the node refuses it"
                    ))
                }
                None => {
                    unusable = Some(format!(
                        "expected a number of seconds greater than 0, got {got}"
                    ))
                }
            },
            "mqtt_port" => match lax_int(v) {
                LaxInt::Int(p) if (1..=65535).contains(&p) => {
                    m.mqtt_port = u16::try_from(p).ok();
                }
                _ => {
                    unusable = Some(format!(
                        "expected a whole number from 1 to 65535, got {got}: the node refuses it"
                    ))
                }
            },
            "upload_results" | "mqtt_use_tls" => match lax_bool(v) {
                Some(b) if key == "upload_results" => m.upload_results = Some(b),
                Some(b) => m.mqtt_use_tls = Some(b),
                None => unusable = refusal.clone(),
            },
            _ => match usable_text(v) {
                Some(s) => {
                    let slot = match key {
                        "install" => &mut m.install,
                        "install_script" => &mut m.install,
                        "inference" => &mut m.inference,
                        "simulate" => &mut m.simulate,
                        "training" => &mut m.training,
                        "profile_slug" => &mut m.profile_slug,
                        "results_folder" => &mut m.results_folder,
                        "mqtt_host" => &mut m.mqtt_host,
                        "mqtt_tls_ca_certs" => &mut m.mqtt_tls_ca_certs,
                        "mqtt_username" => &mut m.mqtt_username,
                        _ => &mut m.mqtt_password,
                    };
                    if key != "install_script" || slot.is_none() {
                        *slot = Some(s);
                    }
                }
                None => unusable = Some(format!("expected a string, got {got}")),
            },
    }
    unusable
}

/// Checks and takes one node setting (the node's own rules: the platform never reads them).
fn node_field(cx: &mut Ctx, m: &mut Manifest, key: &str, line: usize, v: &Node) {
    if v.is_null() {
        return;
    }
    let Some(&(_, kind)) = NODE_FIELDS.iter().find(|(n, _)| *n == key) else {
        return;
    };
    let got = v.describe();
    let ok = match kind {
        NodeKind::Whole(min, max) => match lax_int(v) {
            LaxInt::Int(n) if n >= i128::from(min) && n <= i128::from(max) => {
                let n = u64::try_from(n).unwrap_or(u64::MAX);
                let n32 = u32::try_from(n).unwrap_or(u32::MAX);
                match key {
                    "max_concurrent_workloads" => m.max_concurrent_workloads = Some(n32),
                    "min_free_disk_mb" => m.min_free_disk_mb = Some(n),
                    "max_log_bytes" => m.max_log_bytes = Some(n),
                    "log_retention_days" => m.log_retention_days = Some(n),
                    "gpus_per_workload" => m.gpus_per_workload = Some(n32),
                    _ => m.max_result_bytes = Some(n),
                }
                Ok(())
            }
            _ if max == u64::MAX => Err(format!("expected a whole number ≥ {min}, got {got}")),
            _ => Err(format!(
                "expected a whole number from {min} to {max}, got {got}"
            )),
        },
        // The same range as a command's `max_runtime_seconds` (D20): past it a limit would
        // silently mean "none".
        NodeKind::Seconds => match lax_float(v) {
            Some(f) if f.is_finite() && f > 0.0 && f <= crate::protocol::commands::MAX_SECONDS => {
                m.max_runtime_seconds = Some(f);
                Ok(())
            }
            _ => Err(format!(
                "expected a number of seconds greater than 0 and at most 2592000 (30 days), got {got}"
            )),
        },
        NodeKind::OnOff => match lax_bool(v) {
            Some(b) => {
                m.workflow_reporting = Some(b);
                Ok(())
            }
            None => Err(format!("expected on or off, got {got}")),
        },
        NodeKind::Choice(words) => node_choice(m, key, words, v),
        NodeKind::Text => match usable_text(v) {
            Some(s) => {
                let s = Some(s).filter(|s| !s.trim().is_empty());
                match key {
                    "workload_user" => m.workload_user = s.map(|u| u.trim().to_string()),
                    _ => m.environment_uuid = s,
                }
                Ok(())
            }
            None => Err(format!("expected a string, got {got}")),
        },
    };
    if let Err(why) = ok {
        cx.fatal(line, key, why);
    }
}

/// A node setting that is one of `words` (`services`, `install_user`).
fn node_choice(m: &mut Manifest, key: &str, words: &[&str], v: &Node) -> Result<(), String> {
    let word = usable_text(v).map(|s| s.trim().to_string());
    match word.as_deref() {
        Some(w) if words.contains(&w) => {
            match key {
                "services" => m.keep_services = Some(w == "keep"),
                _ => m.install_as_node = Some(w == "node"),
            }
            Ok(())
        }
        _ => Err(format!(
            "expected {}, got {}",
            words.join(" or "),
            v.describe()
        )),
    }
}

/// A known field within edit distance 2 of `key`, for "did you mean" hints.
fn closest(key: &str, node_only: bool) -> Option<&'static str> {
    let node = NODE_FIELDS.iter().map(|(n, _)| *n);
    let names: Vec<&'static str> = if node_only {
        node.collect()
    } else {
        PLATFORM_FIELDS
            .iter()
            .map(|(n, _)| *n)
            .chain(node)
            .collect()
    };
    names
        .into_iter()
        .map(|n| (n, edit_distance(key, n)))
        .filter(|(_, d)| *d <= if key.chars().count() <= 5 { 1 } else { 2 })
        .min_by_key(|(_, d)| *d)
        .map(|(n, _)| n)
}

// `prev` and `cur` hold b.len() + 1 entries and j < b.len(); a distance is at most a.len() + b.len().
#[allow(clippy::indexing_slicing, clippy::arithmetic_side_effects)]
fn edit_distance(a: &str, b: &str) -> usize {
    if a.chars().count() > 64 {
        return usize::MAX; // no hint for absurd keys (and no quadratic work)
    }
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i.saturating_add(1)];
        for (j, cb) in b.iter().enumerate() {
            let sub = prev
                .get(j)
                .copied()
                .unwrap_or(usize::MAX)
                .saturating_add(usize::from(ca != *cb));
            let del = prev
                .get(j.saturating_add(1))
                .copied()
                .unwrap_or(usize::MAX)
                .saturating_add(1);
            let ins = cur.get(j).copied().unwrap_or(usize::MAX).saturating_add(1);
            cur.push(sub.min(del).min(ins));
        }
        prev = cur;
    }
    prev.last().copied().unwrap_or(usize::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strict(text: &str) -> Checked {
        parse_manifest_text(text, false)
    }

    fn fields(c: &Checked) -> Vec<(&str, Option<usize>, bool)> {
        c.problems
            .iter()
            .map(|p| (p.field.as_str(), p.line, p.warning))
            .collect()
    }

    #[test]
    fn reads_both_wrappers_and_a_flat_file() {
        let c = strict("cyberwave:\n  inference: python i.py {body}\n  install: ./i.sh\n  heartbeat_interval: 5\n");
        assert!(c.valid(), "{:?}", c.problems);
        let m = c.manifest.unwrap();
        assert_eq!(m.wrapper.as_deref(), Some("cyberwave"));
        assert_eq!(m.inference.as_deref(), Some("python i.py {body}"));
        assert_eq!(m.install.as_deref(), Some("./i.sh"));
        assert_eq!(m.heartbeat_interval, Some(5.0));
        assert_eq!(m.section_of("inference"), Some("cyberwave"));
        let c =
            strict("cyberwave-cloud-node:\n  install_script: ./setup.sh\n  training: t {body}\n");
        let m = c.manifest.unwrap();
        assert_eq!(m.install.as_deref(), Some("./setup.sh"));
        let c = strict("install: new\ninstall_script: old\nmqtt_port: 1883\nmqtt_use_tls: false\n");
        assert!(c.valid());
        let m = c.manifest.unwrap();
        assert_eq!(
            m.install.as_deref(),
            Some("new"),
            "install wins in any order"
        );
        assert_eq!((m.mqtt_port, m.mqtt_use_tls), (Some(1883), Some(false)));
        assert!(strict("").valid());
        assert!(strict("cyberwave:\n").valid());
    }

    #[test]
    fn yaml_1_1_values_and_lax_strings_are_used() {
        let c = strict("cyberwave:\n  upload_results: off\n  mqtt_use_tls: \"yes\"\n  mqtt_port: \"1_883\"\n  heartbeat_interval: 1:30\n  gpu: y\n");
        assert!(c.valid(), "{:?}", c.problems);
        let m = c.manifest.unwrap();
        assert_eq!(m.upload_results, Some(false));
        assert_eq!(m.mqtt_use_tls, Some(true));
        assert_eq!(m.mqtt_port, Some(1883));
        assert_eq!(m.heartbeat_interval, Some(90.0));
    }

    #[test]
    fn merged_values_are_really_used_in_both_modes() {
        let text = "base: &b\n  profile_slug: merged\n  results_folder: out\ncyberwave:\n  <<: *b\n  results_folder: own\n";
        for lenient in [false, true] {
            let c = parse_manifest_text(text, lenient);
            assert!(c.valid(), "{:?}", c.problems);
            let m = c.manifest.unwrap();
            assert_eq!(m.profile_slug.as_deref(), Some("merged"));
            assert_eq!(m.results_folder.as_deref(), Some("own"));
        }
    }

    #[test]
    fn platform_refusals_the_node_can_use_do_not_stop_start() {
        let c = strict("cyberwave:\n  version: 1\n  heartbeat_interval: 2.5\n  profile_slug: 123\n  gpu: null\n  provider: aws\n  runtime: vllm\n");
        assert!(!c.valid());
        assert!(c.problems.iter().all(|p| p.start_ok), "{:?}", c.problems);
        assert_eq!(
            fields(&c),
            vec![
                ("version", Some(2), false),
                ("heartbeat_interval", Some(3), false),
                ("profile_slug", Some(4), false),
                ("gpu", Some(5), false),
                ("provider", Some(6), false),
                ("runtime", Some(7), false),
            ]
        );
        let m = c.manifest.unwrap();
        assert_eq!(m.heartbeat_interval, Some(2.5));
        assert_eq!(m.profile_slug.as_deref(), Some("123"));
        let shown = c.problems[4].to_string();
        assert!(
            shown.starts_with("cyberwave.yml:6: error: provider: unknown field")
                && shown.ends_with("[`start` would still run this file]"),
            "{shown}"
        );
    }

    #[test]
    fn lenient_mirrors_the_platform() {
        // Unknown keys under a wrapper: warnings.
        let c = parse_manifest_text("cyberwave:\n  inferense: x\n  server_port: 1\n", true);
        assert!(c.valid());
        assert!(
            c.problems[0].message.contains("did you mean `inference`"),
            "{:?}",
            c.problems
        );
        // In a flat file: still an error, as on the platform.
        let c = parse_manifest_text("inference: x\nserver_port: 1\n", true);
        assert!(!c.valid());
        assert!(c.manifest.is_some(), "start still runs it");
        // A type error stays an error.
        let c = parse_manifest_text("cyberwave:\n  heartbeat_interval: soon\n", true);
        assert!(!c.valid());
        assert!(c.manifest.is_none(), "start cannot use it");
        assert!(c.problems[0].message.contains("\"soon\""));
    }

    #[test]
    fn deliberate_refusals_and_unusable_values_stop_start() {
        for text in [
            "cyberwave:\n  mqtt_port: 70000\n",
            "cyberwave:\n  mqtt_port: 0\n",
            "cyberwave:\n  heartbeat_interval: 0\n",
            "cyberwave:\n  heartbeat_interval: -3\n",
            "cyberwave:\n  heartbeat_interval: .inf\n",
            "cyberwave:\n  heartbeat_interval: 99999999999999999999999999\n",
            "cyberwave:\n  upload_results: maybe\n",
            "cyberwave:\n  inference: [a]\n",
            "cloud_node:\n  max_concurrent_workloads: 0\ncyberwave:\n",
            "cloud_node:\n  max_log_bytes: -1\ncyberwave:\n",
            "cloud_node:\n  gpus_per_workload: 4294967296\ncyberwave:\n",
            "- a\n- b\n",
            "just text\n",
            "a: [unclosed\n",
        ] {
            for lenient in [false, true] {
                let c = parse_manifest_text(text, lenient);
                assert!(!c.valid(), "{text:?}");
                assert!(c.manifest.is_none(), "{text:?}: {:?}", c.problems);
                assert!(c.problems.iter().all(|p| p.line.is_some()));
            }
        }
    }

    #[test]
    fn cloud_node_section_precedence() {
        let c = strict("cyberwave:\n  inference: x\ncloud_node:\n  max_concurrent_workloads: \"3\"\n  max_runtime_seconds: 1.5\n  workflow_reporting: off\n  min_free_disk_mb: 0\n  max_log_bytes: 10\n  log_retention_days: 0\n  gpus_per_workload: 1\n  max_result_bytes: 1_000\n  environment_uuid: \" \"\n");
        assert!(c.valid(), "{:?}", c.problems);
        let m = c.manifest.unwrap();
        assert_eq!(m.max_concurrent_workloads, Some(3));
        assert_eq!(m.max_runtime_seconds, Some(1.5));
        assert_eq!(m.workflow_reporting, Some(false));
        assert_eq!(m.min_free_disk_mb, Some(0));
        assert_eq!(m.max_log_bytes, Some(10));
        assert_eq!(m.log_retention_days, Some(0));
        assert_eq!(m.gpus_per_workload, Some(1));
        assert_eq!(m.max_result_bytes, Some(1000));
        assert_eq!(m.environment_uuid, None, "blank is unset");
        assert_eq!(m.section_of("max_log_bytes"), Some("cloud_node"));
        // Inside the wrapper: read, but the platform refuses it (strict) or drops it (lenient).
        let text = "cyberwave:\n  max_concurrent_workloads: 2\n  max_log_bytes: 7\ncloud_node:\n  max_concurrent_workloads: 4\n  unknown_thing: 1\n";
        let c = strict(text);
        assert!(!c.valid());
        let m = c.manifest.clone().unwrap();
        assert_eq!(m.max_concurrent_workloads, Some(4), "cloud_node: wins");
        assert_eq!(m.max_log_bytes, Some(7));
        assert_eq!(m.section_of("max_log_bytes"), Some("cyberwave"));
        assert_eq!(
            fields(&c),
            vec![
                ("max_concurrent_workloads", Some(2), false),
                ("max_concurrent_workloads", Some(2), true),
                ("max_log_bytes", Some(3), false),
                ("unknown_thing", Some(6), false),
            ]
        );
        let c = parse_manifest_text(text, true);
        assert!(c.valid(), "{:?}", c.problems);
    }

    #[test]
    fn services_and_install_user_take_their_words_only() {
        let c = strict(
            "cyberwave:\n  inference: x\ncloud_node:\n  services: stop\n  install_user: node\n",
        );
        assert!(c.valid(), "{:?}", c.problems);
        let m = c.manifest.unwrap();
        assert_eq!(
            (m.keep_services, m.install_as_node),
            (Some(false), Some(true))
        );
        let m =
            strict("cloud_node:\n  services: keep\n  install_user: workload_user\ncyberwave:\n")
                .manifest
                .unwrap();
        assert_eq!(
            (m.keep_services, m.install_as_node),
            (Some(true), Some(false))
        );
        for bad in [
            "services: kill",
            "services: yes",
            "install_user: root",
            "services: [keep]",
        ] {
            let c = strict(&format!("cloud_node:\n  {bad}\ncyberwave:\n"));
            assert!(!c.valid(), "{bad}");
            let said = c
                .problems
                .iter()
                .map(|p| p.message.clone())
                .collect::<String>();
            assert!(said.contains(" or "), "{bad}: {said}");
        }
    }

    #[test]
    fn wrapper_quirks_follow_the_platform() {
        // A non-mapping wrapper reads as empty; keys beside it are ignored.
        let c = strict("cyberwave: 3\n");
        assert!(c.valid());
        assert!(c.problems[0].warning);
        let c = strict("anchors: &a {x: 1}\ncyberwave:\n  inference: x\ninference: ignored\n");
        assert!(c.valid());
        assert_eq!(c.manifest.clone().unwrap().inference.as_deref(), Some("x"));
        assert_eq!(
            fields(&c),
            vec![("inference", Some(4), true)],
            "only the misplaced setting warns"
        );
        // Falsy documents read as empty, like `safe_load(f) or {}`.
        for text in ["[]\n", "false\n", "0\n", "''\n"] {
            assert!(strict(text).valid(), "{text:?}");
        }
        let c = strict("cyberwave:\n  inference: a\ncyberwave-cloud-node:\n  inference: b\n");
        assert_eq!(c.manifest.unwrap().inference.as_deref(), Some("a"));
    }

    #[test]
    fn never_panics_on_hostile_text() {
        let mut cases: Vec<String> = vec![
            "\u{0}".into(),
            "\u{FEFF}cyberwave:\n  inference: x\n".into(),
            "cyberwave:\n  \u{540d}\u{524d}: \u{30c7}\u{30e2}\n  \"\u{1F680}\": ok\n".into(),
            "cyberwave: &a\n  <<: *a\n".into(),
            "? !!binary aGVsbG8=\n: x\n".into(),
            "cyberwave:\n  requirements: !!set {a, b}\n".into(),
            "cyberwave:\n  heartbeat_interval: !!float 3\n".into(),
            "cyberwave:\n  heartbeat_interval: !!int x\n".into(),
            "%YAML 1.1\n---\ncyberwave: {}\n".into(),
            "cyberwave:\n  mqtt_port: -99999999999999999999999999999999999999999\n".into(),
            "cyberwave:\n  mqtt_port: \"-9223372036854775809000\"\n".into(),
            "cloud_node:\n  max_runtime_seconds: \"nan\"\n".into(),
            "x".repeat(200),
            format!("cyberwave:\n  {}: 1\n", "k".repeat(10_000)),
            "\t\r\n".into(),
        ];
        cases.push("a".repeat(MAX_MANIFEST_BYTES + 1));
        for text in &cases {
            for lenient in [false, true] {
                let c = parse_manifest_text(text, lenient);
                for p in &c.problems {
                    assert!(!p.to_string().is_empty());
                }
            }
        }
        let c = parse_manifest_text(cases.last().unwrap(), false);
        assert!(c.problems[0].message.contains("at most"));
    }

    #[test]
    fn readme_front_matter_keeps_readme_line_numbers() {
        let fm = front_matter("# Title\n---\ninference: x\nbogus: 1\n---\nbody\n").unwrap();
        let c = check(Path::new("README.md"), &fm, false);
        assert_eq!(c.problems[0].line, Some(4));
        assert!(front_matter("no front matter").is_none());
        assert!(front_matter("---\nunterminated").is_none());
    }

    #[test]
    fn locate_prefers_yml_then_readme_and_refuses_binary() {
        let dir = std::env::temp_dir().join(format!("cw-loc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(locate(None, &dir).unwrap().is_none());
        std::fs::write(dir.join("README.md"), "---\ninference: r\n---\n").unwrap();
        let (path, _) = locate(None, &dir).unwrap().unwrap();
        assert!(path.ends_with("README.md"));
        std::fs::write(dir.join("cyberwave.yml"), "inference: y\n").unwrap();
        let (path, _) = locate(None, &dir).unwrap().unwrap();
        assert!(path.ends_with("cyberwave.yml"));
        std::fs::write(dir.join("cyberwave.yml"), b"a: b\nc: \xff\n").unwrap();
        let e = locate(None, &dir).unwrap_err().to_string();
        assert!(
            e.contains("cyberwave.yml:2: error: yaml: the file is not UTF-8"),
            "{e}"
        );
        assert!(locate(Some(&dir.join("nope/x.yml")), &dir).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_utf8_byte_order_mark_is_skipped_as_pyyaml_does() {
        // D49: Windows editors save one; PyYAML skips it, so the platform reads the file.
        let c = parse_manifest_text("\u{FEFF}cyberwave:\n  inference: x {body}\n", false);
        assert!(c.problems.is_empty(), "{:?}", c.problems);
        assert!(c.valid());
        let m = c.manifest.unwrap();
        assert_eq!(m.inference.as_deref(), Some("x {body}"));
        assert_eq!(m.wrapper.as_deref(), Some(WRAPPER_NEW));
        // Line numbers are unchanged by it.
        let c = parse_manifest_text("\u{FEFF}cyberwave:\n  inferense: x\n", false);
        assert_eq!(c.problems[0].line, Some(2), "{:?}", c.problems);
        // Only one, at the very start: a second one is text.
        let c = parse_manifest_text("\u{FEFF}\u{FEFF}cyberwave:\n  inference: x\n", false);
        assert!(!c.valid());
    }

    #[test]
    fn locate_reads_a_bom_file_and_refuses_one_over_the_bound_unread() {
        let dir = std::env::temp_dir().join(format!("cw-bom-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // A README whose front matter follows a byte-order mark.
        std::fs::write(dir.join("README.md"), "\u{FEFF}---\ninference: r\n---\n").unwrap();
        let (path, text) = locate(None, &dir).unwrap().unwrap();
        assert!(path.ends_with("README.md"));
        assert_eq!(
            check(&path, &text, false)
                .manifest
                .unwrap()
                .inference
                .as_deref(),
            Some("r")
        );
        // 5 GiB, sparse: refused from its size, never read into memory.
        let big = dir.join("big.yml");
        let f = std::fs::File::create(&big).unwrap();
        f.set_len(5 << 30).unwrap();
        let e = locate(Some(&big), &dir).unwrap_err().to_string();
        assert!(
            e.contains("big.yml:1: error: yaml: the file is 5368709120 bytes; a manifest may be at most 4194304 (4 MiB)"),
            "{e}"
        );
        // One byte over the bound is refused; the bound itself is read.
        f.set_len(u64::try_from(MAX_MANIFEST_BYTES).unwrap() + 1)
            .unwrap();
        assert!(locate(Some(&big), &dir)
            .unwrap_err()
            .to_string()
            .contains("4194305 bytes"));
        f.set_len(u64::try_from(MAX_MANIFEST_BYTES).unwrap())
            .unwrap();
        assert!(locate(Some(&big), &dir).is_ok());
        // UTF-16 is named as such.
        std::fs::write(&big, b"\xff\xfec\x00y\x00").unwrap();
        assert!(locate(Some(&big), &dir)
            .unwrap_err()
            .to_string()
            .contains("UTF-16"));
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

    #[test]
    fn d63_a_quoted_body_is_a_warning_on_the_templates_key() {
        let c = strict("cyberwave-cloud-node:\n  profile_slug: p\n  inference: |\n    curl -sf -X POST http://localhost:8080/act \\\n      -d '{body}'\n  training: python t.py {body}\n  simulate: \"sim.py\"\n");
        assert!(c.valid(), "{:?}", c.problems);
        assert_eq!(fields(&c), vec![("inference", Some(3), true)]);
        let p = c.problems[0].to_string();
        assert!(p.contains("single quotes (line 2 of the template)"), "{p}");
        assert!(c.manifest.is_some());
    }
}
