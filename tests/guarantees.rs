//! GUARANTEES.md is an index of guarantees → the tests that prove them: every test it names
//! exists, and the end-to-end tests follow one naming scheme (CONTRIBUTING.md, "Naming tests
//! after guarantees"): a test listed under guarantee N is `gN_…`, and a `gN_…` test is listed
//! under N.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The repository's root (also for `decisions.rs`).
pub(crate) fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The index: each end-to-end test path (`module::…::name`, no `src/`) → the guarantees it is
/// listed under, in order; and every other backticked name that looks like a test's (five words
/// or more).
fn index() -> (BTreeMap<String, Vec<u32>>, BTreeSet<String>) {
    let text = std::fs::read_to_string(root().join("GUARANTEES.md")).expect("GUARANTEES.md");
    let (mut e2e, mut other) = (BTreeMap::<String, Vec<u32>>::new(), BTreeSet::new());
    let mut section = None;
    for line in text.lines() {
        if let Some(h) = line.strip_prefix("## ") {
            section = h.split('.').next().and_then(|n| n.parse::<u32>().ok());
            continue;
        }
        let Some(n) = section else { continue };
        for quoted in line.split('`').skip(1).step_by(2) {
            let ident = |s: &str| {
                !s.is_empty()
                    && s.chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
            };
            if quoted.contains("::") && quoted.split("::").all(ident) {
                e2e.entry(quoted.to_string()).or_default().push(n);
            } else if ident(quoted) && quoted.split('_').count() >= 5 {
                other.insert(quoted.to_string());
            }
        }
    }
    (e2e, other)
}

/// Every `.rs` file below `dir`, in order.
pub(crate) fn sources(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).expect("read dir").flatten() {
        let p = entry.path();
        if p.is_dir() {
            out.extend(sources(&p));
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
    out.sort();
    out
}

/// The names of the `#[test]` functions in this source text.
pub(crate) fn test_fns(text: &str) -> Vec<String> {
    let lines: Vec<&str> = text.lines().map(str::trim).collect();
    let mut out = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        if *l != "#[test]" {
            continue;
        }
        let name = lines[i + 1..]
            .iter()
            .find(|l| !l.starts_with("#["))
            .and_then(|l| l.strip_prefix("fn "))
            .and_then(|l| l.split('(').next());
        if let Some(name) = name {
            out.push(name.to_string());
        }
    }
    out
}

/// The source file an end-to-end test path lives in: `tests/a.rs` for `a::name`,
/// `tests/a/b.rs` for `a::b::name`, or `tests/a.rs` holding an inline `mod b`.
pub(crate) fn file_of(path: &str) -> Option<PathBuf> {
    let segs: Vec<&str> = path.split("::").collect();
    let mods = &segs[..segs.len() - 1];
    (1..=mods.len()).rev().find_map(|k| {
        let p = root()
            .join("tests")
            .join(mods[..k].join("/"))
            .with_extension("rs");
        p.is_file().then_some(p)
    })
}

#[test]
fn every_test_guarantees_md_names_exists_and_follows_the_naming_scheme() {
    let (e2e, other) = index();
    assert!(e2e.len() > 100, "the index lists {} e2e tests", e2e.len());
    let mut problems = Vec::new();
    for (path, sections) in &e2e {
        let name = path.rsplit("::").next().unwrap_or_default();
        let exists = file_of(path).is_some_and(|f| {
            test_fns(&std::fs::read_to_string(f).unwrap_or_default()).contains(&name.to_string())
        });
        if !exists {
            problems.push(format!("`{path}` is not a test"));
        }
        let first = sections[0];
        if !name.starts_with(&format!("g{first}_")) {
            problems.push(format!(
                "`{path}` is listed under guarantee {first}: name it g{first}_…"
            ));
        }
    }
    // Unit tests are listed by file and name; each name is a function somewhere.
    let all: String = sources(&root().join("src"))
        .into_iter()
        .chain(sources(&root().join("tests")))
        .map(|p| std::fs::read_to_string(p).unwrap_or_default())
        .collect();
    for name in &other {
        if !all.contains(&format!("fn {name}(")) {
            problems.push(format!("`{name}` is no function in src/ or tests/"));
        }
    }
    // And the other way: an end-to-end test named after a guarantee is listed under it.
    for file in sources(&root().join("tests")) {
        let text = std::fs::read_to_string(&file).unwrap_or_default();
        for name in test_fns(&text) {
            let tagged = name
                .strip_prefix('g')
                .and_then(|r| r.split_once('_'))
                .and_then(|(n, _)| n.parse::<u32>().ok());
            if name.starts_with("guarantee_") {
                problems.push(format!("{name} ({}): the scheme is gN_…", file.display()));
            }
            let Some(n) = tagged else { continue };
            let listed = e2e
                .iter()
                .any(|(p, s)| p.ends_with(&format!("::{name}")) && s.contains(&n));
            if !listed {
                problems.push(format!(
                    "{name} ({}) is not listed under guarantee {n}",
                    file.display()
                ));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "GUARANTEES.md and the test names disagree:\n{}",
        problems.join("\n")
    );
}
