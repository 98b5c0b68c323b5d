//! The repository defines every number it uses (D72). `docs/decisions.md` has a `### DNN — …`
//! heading for each decision, followed by a `Tests:` paragraph naming what proves it
//! (end-to-end tests as `module::name`, unit tests as `src/file.rs` `name`), or a line starting
//! `Not implemented`, `Replaced by` or `No test:`. `docs/protocol.md` has a `### RNN — …` or
//! `### ENN — …` heading for each MQTT exchange and REST call. These tests check that:
//! - every test `docs/decisions.md` names exists, and every decision names its proof;
//! - every test whose name carries `dNN_` (or `gN_dNN_`) is listed under DNN;
//! - every `DNN` (or `dNN_`) used in any file of the repository has its heading;
//! - every `RNN` / `ENN` used in any file has its heading in `docs/protocol.md`;
//! - no file names an issue number, an item or a review finding of a list kept elsewhere, tells
//!   history in a comment, or names a document outside the repository (ignored until the
//!   comments are swept; run it with `--ignored` to list what is left).
//!
//! Each failure says, per line, what to change and where.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use crate::guarantees::{file_of, root, sources, test_fns};

const DECISIONS: &str = "docs/decisions.md";
const PROTOCOL: &str = "docs/protocol.md";

/// Where a name or a number was read: `file:line`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct At(String, usize);

impl std::fmt::Display for At {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.0, self.1)
    }
}

/// One `### DNN` section of `docs/decisions.md`.
#[derive(Debug, Default)]
struct Decision {
    line: usize,
    /// End-to-end tests: `module::…::name`.
    e2e: Vec<(String, usize)>,
    /// Unit tests: (`src/file.rs`, name).
    unit: Vec<(String, String, usize)>,
    /// Says it is not implemented, replaced, or has no test (and why).
    exempt: bool,
}

fn is_ident(s: &str) -> bool {
    !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

/// The number of a heading `### <letter>NN — …`.
fn heading_number(line: &str, letter: char) -> Option<u32> {
    let rest = line.strip_prefix("### ")?.strip_prefix(letter)?;
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    let after = rest.get(digits.len()..).unwrap_or("");
    if after.starts_with(char::is_alphanumeric) {
        return None;
    }
    digits.parse().ok()
}

/// `docs/decisions.md`, read: its decisions by number, and what in it cannot be read.
fn decisions() -> (BTreeMap<u32, Decision>, Vec<String>) {
    let text = std::fs::read_to_string(root().join(DECISIONS)).expect("docs/decisions.md");
    let (mut out, mut problems) = (BTreeMap::<u32, Decision>::new(), Vec::new());
    let mut current: Option<u32> = None;
    let mut in_tests = false;
    let mut file: Option<String> = None;
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        if line.starts_with('#') {
            in_tests = false;
            current = heading_number(line, 'D');
            if line.starts_with("### ") && current.is_none() {
                problems.push(format!(
                    "{DECISIONS}:{n}: a `###` heading must be `### DNN — title`"
                ));
            }
            if let Some(id) = current {
                if out.contains_key(&id) {
                    problems.push(format!(
                        "{DECISIONS}:{n}: D{id} has a second heading; keep one"
                    ));
                }
                out.entry(id).or_default().line = n;
            }
            continue;
        }
        let Some(id) = current else { continue };
        let Some(d) = out.get_mut(&id) else { continue };
        if line.trim().is_empty() {
            in_tests = false;
            continue;
        }
        if ["Not implemented", "Replaced by", "No test:"]
            .iter()
            .any(|p| line.starts_with(p))
        {
            d.exempt = true;
        }
        if line.starts_with("Tests:") {
            in_tests = true;
            file = None;
        }
        if !in_tests {
            continue;
        }
        for token in line.split('`').skip(1).step_by(2) {
            if token.contains("::") && token.split("::").all(is_ident) {
                d.e2e.push((token.to_string(), n));
            } else if token.starts_with("src/") && token.ends_with(".rs") {
                file = Some(token.to_string());
            } else if let (true, Some(f)) = (is_ident(token), &file) {
                d.unit.push((f.clone(), token.to_string(), n));
            } else {
                problems.push(format!(
                    "{DECISIONS}:{n}: `{token}` under D{id} is not a test: write an end-to-end test as `module::name` and a unit test as `src/file.rs` `name`"
                ));
            }
        }
    }
    (out, problems)
}

fn tests_in(file: &Path) -> Vec<String> {
    test_fns(&std::fs::read_to_string(file).unwrap_or_default())
}

fn rel(p: &Path) -> String {
    p.strip_prefix(root()).unwrap_or(p).display().to_string()
}

/// The decision a test's name carries: `dNN_…` or `gN_dNN_…`.
fn tagged(name: &str) -> Option<u32> {
    let rest = match name.strip_prefix('g') {
        Some(r) => match r.split_once('_') {
            Some((n, tail)) if !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()) => tail,
            _ => name,
        },
        None => name,
    };
    let (n, _) = rest.strip_prefix('d')?.split_once('_')?;
    if n.is_empty() || !n.chars().all(|c| c.is_ascii_digit()) {
        return None;
    }
    n.parse().ok()
}

#[test]
fn d72_every_test_docs_decisions_md_names_exists_and_every_decision_names_its_proof() {
    let (decisions, mut problems) = decisions();
    if decisions.len() < 72 {
        problems.push(format!(
            "{DECISIONS} has {} decisions, fewer than 72",
            decisions.len()
        ));
    }
    let last = decisions.keys().max().copied().unwrap_or(0);
    for id in 1..=last {
        if !decisions.contains_key(&id) {
            problems.push(format!(
                "{DECISIONS}: D{id} has no heading: a number is never skipped; add `### D{id} — title` (say `Replaced by …` or `Not implemented` if so)"
            ));
        }
    }
    for (id, d) in &decisions {
        for (path, n) in &d.e2e {
            let name = path.rsplit("::").next().unwrap_or_default().to_string();
            if !file_of(path).is_some_and(|f| tests_in(&f).contains(&name)) {
                problems.push(format!(
                    "{DECISIONS}:{n}: `{path}` (under D{id}) is no test in tests/: write its current name (`module::name`), or remove it if the test is gone"
                ));
            }
        }
        for (file, name, n) in &d.unit {
            if !tests_in(&root().join(file)).contains(name) {
                problems.push(format!(
                    "{DECISIONS}:{n}: `{file}` `{name}` (under D{id}) is no #[test] in {file}: write its current file and name, or remove it if the test is gone"
                ));
            }
        }
        if d.e2e.is_empty() && d.unit.is_empty() && !d.exempt {
            problems.push(format!(
                "{DECISIONS}:{}: D{id} names no test: add a `Tests:` paragraph, or a line `Not implemented …`, `Replaced by …` or `No test: <why>`",
                d.line
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn d72_every_decision_test_is_listed_under_its_decision() {
    let (decisions, _) = decisions();
    let mut problems = Vec::new();
    for file in sources(&root().join("tests")) {
        let module = rel(&file)
            .trim_start_matches("tests/")
            .trim_end_matches(".rs")
            .replace('/', "::");
        for name in tests_in(&file) {
            let Some(id) = tagged(&name) else { continue };
            let listed = decisions.get(&id).is_some_and(|d| {
                d.e2e
                    .iter()
                    .any(|(p, _)| p.rsplit("::").next() == Some(name.as_str()))
            });
            if !listed {
                problems.push(format!(
                    "{}: test {name} carries D{id}: list `{module}::{name}` in the `Tests:` paragraph of `### D{id}` in {DECISIONS}",
                    rel(&file)
                ));
            }
        }
    }
    for file in sources(&root().join("src")) {
        let f = rel(&file);
        for name in tests_in(&file) {
            let Some(id) = tagged(&name) else { continue };
            let listed = decisions
                .get(&id)
                .is_some_and(|d| d.unit.iter().any(|(uf, un, _)| *uf == f && *un == name));
            if !listed {
                problems.push(format!(
                    "{f}: test {name} carries D{id}: list `{f}` `{name}` in the `Tests:` paragraph of `### D{id}` in {DECISIONS}"
                ));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// Every text file of the repository (not build output, fetched files, fuzz inputs or
/// `Cargo.lock`), as (path relative to the root, text).
fn repository_files() -> Vec<(String, String)> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries.flatten() {
            let p = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            let skipped = (name.starts_with('.') && name != ".ci")
                || matches!(name.as_str(), "target" | "__pycache__" | "Cargo.lock")
                || p.ends_with("fuzz/corpus")
                || p.ends_with("fuzz/artifacts");
            if skipped {
                continue;
            }
            if p.is_dir() {
                walk(&p, out);
            } else {
                out.push(p);
            }
        }
    }
    let mut paths = Vec::new();
    walk(&root(), &mut paths);
    paths.sort();
    paths
        .into_iter()
        .filter_map(|p| Some((rel(&p), std::fs::read_to_string(&p).ok()?)))
        .collect()
}

/// The words of `line`: runs of ASCII letters, digits and `_`.
fn words(line: &str) -> impl Iterator<Item = &str> {
    line.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| !w.is_empty())
}

/// A word that is `<letter>NN` exactly (one or two digits, no leading zero): its number. A
/// driver branch (`R450`) or a hex digit run (`E000`) is no id.
fn numbered(word: &str, letter: char) -> Option<u32> {
    let digits = word.strip_prefix(letter)?;
    let ok = matches!(digits.len(), 1 | 2)
        && !digits.starts_with('0')
        && digits.chars().all(|c| c.is_ascii_digit());
    ok.then(|| digits.parse().ok()).flatten()
}

#[test]
fn d72_every_decision_number_used_in_the_repository_has_its_heading() {
    let (decisions, _) = decisions();
    let mut problems = BTreeMap::<u32, BTreeSet<At>>::new();
    for (file, text) in repository_files() {
        for (i, line) in text.lines().enumerate() {
            for w in words(line) {
                let id = numbered(w, 'D').or_else(|| tagged(w));
                if let Some(id) = id.filter(|id| !decisions.contains_key(id)) {
                    problems
                        .entry(id)
                        .or_default()
                        .insert(At(file.clone(), i + 1));
                }
            }
        }
    }
    assert_none_used(&problems, |id| {
        format!("D{id} is used but has no `### D{id}` heading in {DECISIONS} (define it there, or use a defined number)")
    });
}

/// Fails with one line per undefined id: what to do about it, then where it is used.
fn assert_none_used<K>(problems: &BTreeMap<K, BTreeSet<At>>, what: impl Fn(&K) -> String) {
    let lines: Vec<String> = problems
        .iter()
        .map(|(id, at)| {
            let at: Vec<String> = at.iter().map(ToString::to_string).collect();
            format!("{}: {}", what(id), at.join(", "))
        })
        .collect();
    assert!(lines.is_empty(), "{}", lines.join("\n"));
}

#[test]
fn d72_every_protocol_id_used_in_the_repository_is_defined_in_docs_protocol_md() {
    let text = std::fs::read_to_string(root().join(PROTOCOL)).expect("docs/protocol.md");
    let defined: BTreeSet<(char, u32)> = text
        .lines()
        .flat_map(|l| {
            ['R', 'E']
                .into_iter()
                .filter_map(move |c| heading_number(l, c).map(|n| (c, n)))
        })
        .collect();
    let mut problems = BTreeMap::<(char, u32), BTreeSet<At>>::new();
    for (file, text) in repository_files() {
        for (i, line) in text.lines().enumerate() {
            for w in words(line) {
                for c in ['R', 'E'] {
                    if let Some(n) = numbered(w, c).filter(|n| !defined.contains(&(c, *n))) {
                        problems
                            .entry((c, n))
                            .or_default()
                            .insert(At(file.clone(), i + 1));
                    }
                }
            }
        }
    }
    assert_none_used(&problems, |(c, n)| {
        format!("{c}{n} is used but not defined in {PROTOCOL} (add `### {c}{n} — name` there, or name the exchange in words)")
    });
}

/// Whether `lower` (a lowercased line) holds `word` followed at once by a number (`issue 25`,
/// `item 5`, `finding 2`; `#` before the number too). Not after a public repository's
/// `owner/name` (`gpustack/gpustack issue #2078`): anyone can look that up.
fn numbered_after(lower: &str, word: &str) -> bool {
    lower.match_indices(word).any(|(i, m)| {
        let before = lower.get(..i).unwrap_or("");
        let word_start = !before.ends_with(|c: char| c.is_ascii_alphanumeric());
        let public = before
            .split_whitespace()
            .next_back()
            .is_some_and(|w| w.contains('/'));
        let rest = lower.get(i + m.len()..).unwrap_or("");
        let rest = rest.strip_prefix('#').unwrap_or(rest);
        word_start && !public && rest.starts_with(|c: char| c.is_ascii_digit())
    })
}

/// What on `line` of `file` refers to something outside the repository, if anything.
fn outside_reference(file: &str, line: &str) -> Option<&'static str> {
    let lower = line.to_lowercase();
    if numbered_after(&lower, "issue ") {
        return Some("an issue number: say what the code does and why (history belongs in git)");
    }
    if numbered_after(&lower, "item ") || numbered_after(&lower, "items ") {
        return Some("an item of a list outside the repository: say what it is in words");
    }
    if numbered_after(&lower, "finding ") {
        return Some("a review finding: say what the code guards against and why");
    }
    const HISTORY: [&str; 3] = ["on the node before", "review round", "the last review"];
    if HISTORY.iter().any(|h| lower.contains(h)) {
        return Some("history: say what holds and why (history belongs in git)");
    }
    const DOCUMENTS: [&str; 9] = [
        "design.md",
        "design §",
        "behaviour.md",
        "ecosystem.md",
        "ecosystem §",
        "protocol §",
        "execution-ingress.md",
        "developers.md",
        "shared/spec",
    ];
    if DOCUMENTS.iter().any(|d| lower.contains(d)) {
        return Some("a document outside the repository: say it in words, or point to docs/");
    }
    // A section sign names a section of some document: fine for a public standard (RFC, MQTT).
    let outside_section = line.match_indices('§').any(|(i, _)| {
        let before: Vec<char> = line.get(..i).unwrap_or("").chars().collect();
        let near: String = before[before.len().saturating_sub(24)..].iter().collect();
        !(near.contains("RFC") || near.contains("MQTT"))
    });
    if outside_section {
        return Some("a section of an outside document: say it in words, or point to docs/");
    }
    let in_docs = file.starts_with("docs/");
    let outside_copy = |doc: &str| {
        line.match_indices(doc)
            .any(|(i, _)| !line.get(..i).is_some_and(|b| b.ends_with("docs/")))
    };
    if !in_docs && (outside_copy("decisions.md") || outside_copy("protocol.md")) {
        return Some("a decisions.md or protocol.md outside docs/: point to docs/decisions.md or docs/protocol.md");
    }
    None
}

/// Each form `outside_reference` looks for is caught, and what merely looks like one is not.
#[test]
fn outside_reference_catches_each_form_and_passes_plain_words() {
    let caught = [
        "// one system call less per start (issue 25 item 5)",
        "/// Finding 2 of Issue 11: a multibyte character",
        "see issue #25",
        "// A second cancel changes nothing (finding 10: the deadline is not pushed out).",
        "// the figures of item 3",
        "// issue items 3 and 4",
        "/// On the node before, the first preview's end killed the server.",
        "// was changed because the last review asked",
        "//! Errors as types (DESIGN §5)",
        "// the layout of design.md",
        "// as behaviour.md §15 says",
        "// ecosystem §2.2",
        "// protocol §4.1",
        "// see /work/shared/spec/decisions.md",
        "// the rules of a section § 4",
        "// see decisions.md",
        "// see spec/protocol.md",
    ];
    for line in caught {
        assert!(
            outside_reference("src/x.rs", line).is_some(),
            "not caught: {line}"
        );
    }
    let plain = [
        "// one system call less per start",
        "for item in items.iter() {",
        "// a topic of 65 535 bytes at most (MQTT 3.1.1 §4.7)",
        "// the unreserved bytes of RFC 3986 §3.3",
        "// see docs/decisions.md and docs/protocol.md",
        "// the reissue 3 times is a word, not an issue",
        "| reported in gpustack/gpustack issue #2078 |",
        "// findings 2 and 3 are not numbered after their word",
        "// the GPU captures of ../shared/fixtures/gpu/real (data, not a document)",
    ];
    for line in plain {
        assert_eq!(outside_reference("src/x.rs", line), None, "{line}");
    }
    assert_eq!(outside_reference("docs/x.md", "see protocol.md"), None);
}

#[test]
fn d72_no_file_names_an_issue_or_a_document_outside_the_repository() {
    let mut problems = Vec::new();
    for (file, text) in repository_files() {
        // This file names what it looks for.
        if file == "tests/decisions.rs" {
            continue;
        }
        for (i, line) in text.lines().enumerate() {
            if let Some(what) = outside_reference(&file, line) {
                problems.push(format!("{file}:{}: {what}: {}", i + 1, line.trim()));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "{} line(s) refer outside the repository:\n{}",
        problems.len(),
        problems.join("\n")
    );
}
