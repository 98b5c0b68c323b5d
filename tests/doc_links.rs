//! The documentation's links hold: every relative markdown link in README.md, CONTRIBUTING.md,
//! GUARANTEES.md and `docs/*.md` names a file or folder that exists, and every `#anchor` (in the
//! same page or another markdown page) matches a heading as GitHub turns it into an anchor. A
//! section moved from one page to another breaks the links to it; this names each one with its
//! `file:line`. The README is a user's page, kept to 400 lines; what does not fit goes to
//! `docs/`.

use std::collections::BTreeSet;
use std::path::{Component, Path, PathBuf};

use crate::guarantees::root;

/// The most lines the README may have.
const README_MAX_LINES: usize = 400;

/// The pages whose links are checked, relative to the root.
fn pages() -> Vec<String> {
    let mut out: Vec<String> = ["README.md", "CONTRIBUTING.md", "GUARANTEES.md"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let mut docs: Vec<String> = std::fs::read_dir(root().join("docs"))
        .expect("docs/")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".md"))
        .map(|n| format!("docs/{n}"))
        .collect();
    docs.sort();
    out.extend(docs);
    out
}

/// The lines of a markdown text that are not inside a fenced code block, with their numbers
/// (from 1).
fn prose_lines(text: &str) -> Vec<(usize, &str)> {
    let mut fence: Option<&str> = None;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let t = line.trim_start();
        let marker = ["```", "~~~"].into_iter().find(|m| t.starts_with(m));
        match (fence, marker) {
            (None, Some(m)) => fence = Some(m),
            (Some(f), Some(m)) if f == m => fence = None,
            (None, None) => out.push((i + 1, line)),
            _ => {}
        }
    }
    out
}

/// `line` without its inline code spans (a link written inside backticks is no link).
fn without_code(line: &str) -> String {
    line.split('`').step_by(2).collect::<Vec<_>>().join(" ")
}

/// The anchor GitHub gives a heading: its text without markup, lower case, every character
/// that is not a letter, digit, `_`, `-` or space dropped, spaces turned into `-`.
fn slug(heading: &str) -> String {
    // Links in a heading keep their text only.
    let mut text = String::new();
    let mut rest = heading;
    while let Some(open) = rest.find('[') {
        let (before, after) = rest.split_at(open);
        text.push_str(before);
        match after.find("](").zip(after.find(')')) {
            Some((mid, close)) if mid < close => {
                text.push_str(after.get(1..mid).unwrap_or(""));
                rest = after.get(close + 1..).unwrap_or("");
            }
            _ => {
                text.push('[');
                rest = after.get(1..).unwrap_or("");
            }
        }
    }
    text.push_str(rest);
    text.to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, '_' | '-' | ' '))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// Every anchor a markdown page has: one per heading, a repeated one with `-1`, `-2`, … as
/// GitHub numbers them.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (_, line) in prose_lines(text) {
        let hashes = line.chars().take_while(|c| *c == '#').count();
        let Some(title) = line.get(hashes..).and_then(|t| t.strip_prefix(' ')) else {
            continue;
        };
        if !(1..=6).contains(&hashes) {
            continue;
        }
        let base = slug(title.trim().trim_end_matches('#').trim());
        let mut anchor = base.clone();
        let mut n = 0;
        while out.contains(&anchor) {
            n += 1;
            anchor = format!("{base}-{n}");
        }
        out.insert(anchor);
    }
    out
}

/// The targets of the inline links `[text](target)` of a page, with their line numbers.
fn links(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (n, line) in prose_lines(text) {
        let line = without_code(line);
        let mut rest = line.as_str();
        while let Some(at) = rest.find("](") {
            let after = rest.get(at + 2..).unwrap_or("");
            let end = after.find(')').unwrap_or(after.len());
            let target = after.get(..end).unwrap_or("").trim();
            // `[text](target "title")`: the target is the first word.
            let target = target.split_whitespace().next().unwrap_or("");
            out.push((n, target.to_string()));
            rest = after.get(end..).unwrap_or("");
        }
    }
    out
}

/// `base/rel` with `.` and `..` worked out; `None` when it climbs above the root.
fn join(base: &Path, rel: &str) -> Option<PathBuf> {
    let mut out = Vec::new();
    for c in base.join(rel).components() {
        match c {
            Component::Normal(s) => out.push(s.to_owned()),
            Component::ParentDir => {
                out.pop()?;
            }
            _ => {}
        }
    }
    Some(out.iter().collect())
}

/// What is wrong with the links of `pages` (path relative to the root, text), one line per
/// broken link: `file:line: …`. `read` gives a path's text (`Some("")` for a folder or a file
/// that is not text), `None` when nothing is there.
fn broken_links(pages: &[(String, String)], read: impl Fn(&Path) -> Option<String>) -> Vec<String> {
    let mut problems = Vec::new();
    for (page, text) in pages {
        let dir = Path::new(page).parent().unwrap_or(Path::new(""));
        for (n, target) in links(text) {
            let external = target.contains("://") || target.starts_with("mailto:");
            if external || target.is_empty() {
                continue;
            }
            let (file, anchor) = match target.split_once('#') {
                Some((f, a)) => (f, Some(a)),
                None => (target.as_str(), None),
            };
            let (path, linked) = if file.is_empty() {
                (PathBuf::from(page), Some(text.clone()))
            } else {
                match join(dir, file) {
                    Some(p) => {
                        let t = read(&p);
                        (p, t)
                    }
                    None => {
                        problems.push(format!(
                            "{page}:{n}: `{target}` points above the repository"
                        ));
                        continue;
                    }
                }
            };
            let Some(linked) = linked else {
                problems.push(format!(
                    "{page}:{n}: `{target}`: {} does not exist",
                    path.display()
                ));
                continue;
            };
            let markdown = path.extension().is_some_and(|e| e == "md");
            if let Some(anchor) = anchor.filter(|_| markdown) {
                if !anchors(&linked).contains(anchor) {
                    problems.push(format!(
                        "{page}:{n}: `{target}`: {} has no heading whose anchor is #{anchor}",
                        path.display()
                    ));
                }
            }
        }
    }
    problems
}

/// A path below the root: its text, `Some("")` for a folder or a file that is not text.
fn read_in_repository(path: &Path) -> Option<String> {
    let p = root().join(path);
    if p.is_dir() {
        return Some(String::new());
    }
    p.is_file()
        .then(|| std::fs::read_to_string(&p).unwrap_or_default())
}

#[test]
fn a_broken_link_or_anchor_is_named_with_its_file_and_line() {
    let readme = "# Title\n\n## The workload's environment\n\nSee [env](#the-workloads-environment), \
[gone](#no-such-heading).\n\n```sh\n# not a heading\n[not a link](nowhere.md)\n```\n\
[guide](docs/guide.md#setting-up-cyberwaveyml--the-file) and [missing](docs/missing.md) and `[code](x.md)`.\n\
[bad anchor](docs/guide.md#not-a-heading) [dir](docs/) [web](https://example.com/x#y)\n\
## Steps\n## Steps\n[second](#steps-1) [third](#steps-2) [up](../outside.md)\n";
    let guide = "# Guide\n\n## Setting up `cyberwave.yml` — [the file](x.md)\n\n[back](../README.md#title)\n\
[back](../README.md#not-a-heading)\n";
    let pages = [
        ("README.md".to_string(), readme.to_string()),
        ("docs/guide.md".to_string(), guide.to_string()),
    ];
    let read = |p: &Path| match p.to_str() {
        Some("docs/guide.md") => Some(guide.to_string()),
        Some("README.md") => Some(readme.to_string()),
        Some("docs") => Some(String::new()),
        _ => None,
    };
    let problems = broken_links(&pages, read);
    assert_eq!(
        problems,
        [
            "README.md:5: `#no-such-heading`: README.md has no heading whose anchor is #no-such-heading",
            "README.md:11: `docs/missing.md`: docs/missing.md does not exist",
            "README.md:12: `docs/guide.md#not-a-heading`: docs/guide.md has no heading whose anchor is #not-a-heading",
            "README.md:15: `#steps-2`: README.md has no heading whose anchor is #steps-2",
            "README.md:15: `../outside.md` points above the repository",
            "docs/guide.md:3: `x.md`: docs/x.md does not exist",
            "docs/guide.md:6: `../README.md#not-a-heading`: README.md has no heading whose anchor is #not-a-heading",
        ],
        "{problems:#?}"
    );
    assert!(anchors(guide).contains("setting-up-cyberwaveyml--the-file"));
}

#[test]
fn every_relative_link_and_anchor_in_the_documentation_resolves() {
    let pages: Vec<(String, String)> = pages()
        .into_iter()
        .map(|p| {
            let text = std::fs::read_to_string(root().join(&p)).expect("a documentation page");
            (p, text)
        })
        .collect();
    let problems = broken_links(&pages, read_in_repository);
    assert!(
        problems.is_empty(),
        "links that lead nowhere (fix the link, or the heading it names):\n{}",
        problems.join("\n")
    );
}

#[test]
fn the_readme_is_a_page_a_user_reads_through() {
    let lines = std::fs::read_to_string(root().join("README.md"))
        .expect("README.md")
        .lines()
        .count();
    assert!(
        lines <= README_MAX_LINES,
        "README.md has {lines} lines, at most {README_MAX_LINES}: move reference detail to docs/ and link it"
    );
}
