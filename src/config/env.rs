//! Environment variables and `.env` files, layered in the documented order (decision D14):
//! process environment > `./.env` (working dir) > `<config dir>/.env`. The node never writes
//! them into its own process environment; every lookup goes through [`EnvLayers`], which also
//! says where a value came from.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::Source;

/// Why a `.env` file cannot be used.
#[derive(Debug)]
pub enum DotenvError {
    /// It exists but cannot be read (or is no regular file, or too big, or not UTF-8).
    Unreadable(PathBuf, crate::store::StoreError),
    /// A line that is not python-dotenv.
    Syntax(PathBuf, SyntaxError),
}

impl std::fmt::Display for DotenvError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DotenvError::Unreadable(path, e) => write!(f, "cannot read {}: {e}", path.display()),
            DotenvError::Syntax(path, e) => write!(f, "{}:{}: {e}", path.display(), e.line),
        }
    }
}

impl std::error::Error for DotenvError {}

/// A line of a `.env` file that does not parse: its number (from 1) and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyntaxError {
    pub line: usize,
    pub problem: Syntax,
}

/// What is wrong with a `.env` line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Syntax {
    /// No `=`; the line's first 40 characters.
    NoEquals(String),
    /// A name of other than letters, digits, `_` and `.`; its first 40 characters.
    BadName(String),
    UnterminatedSingle,
    UnterminatedDouble,
}

impl std::fmt::Display for SyntaxError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.problem {
            Syntax::NoEquals(line) => write!(f, "expected KEY=VALUE, got {line:?}"),
            Syntax::BadName(key) => write!(f, "invalid variable name {key:?}"),
            Syntax::UnterminatedSingle => write!(f, "unterminated single quote"),
            Syntax::UnterminatedDouble => write!(f, "unterminated double quote"),
        }
    }
}

#[derive(Debug, Clone, Default)]
pub struct EnvLayers {
    process: BTreeMap<String, String>,
    /// (path, variables) highest first: `./.env`, then `<config dir>/.env`.
    files: Vec<(PathBuf, BTreeMap<String, String>)>,
}

impl EnvLayers {
    pub fn new(process: BTreeMap<String, String>) -> Self {
        EnvLayers {
            process,
            files: Vec::new(),
        }
    }

    pub fn from_process() -> Self {
        // Variables that are not valid UTF-8 cannot be settings; they are passed over here and
        // still reach workloads untouched through the inherited environment.
        Self::new(
            std::env::vars_os()
                .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
                .collect(),
        )
    }

    /// Adds a `.env` file below the layers already present. A missing file is not an error;
    /// an unreadable one is.
    pub fn add_dotenv(&mut self, path: &Path) -> Result<(), DotenvError> {
        // Never a FIFO or a link (D48): `<state dir>/.env` is within a workload's reach.
        let read =
            crate::store::read_state_file(path, crate::store::MAX_ENTRY_BYTES).and_then(|b| {
                String::from_utf8(b).map_err(|_| {
                    crate::store::StoreError::Invalid("stream did not contain valid UTF-8".into())
                })
            });
        match read {
            Ok(text) => {
                let vars = parse_dotenv(&text, |name| self.get(name).map(|(v, _)| v))
                    .map_err(|e| DotenvError::Syntax(path.to_path_buf(), e))?;
                self.files.push((path.to_path_buf(), vars));
                Ok(())
            }
            Err(crate::store::StoreError::Missing) => Ok(()),
            Err(e) => Err(DotenvError::Unreadable(path.to_path_buf(), e)),
        }
    }

    /// The value of `name` from the highest layer that has it, with its source. An empty
    /// value counts as unset, as it does for every Cyberwave tool.
    pub fn get(&self, name: &str) -> Option<(String, Source)> {
        if let Some(v) = self.process.get(name) {
            if !v.trim().is_empty() {
                return Some((v.clone(), Source::Env(name.to_string())));
            }
        }
        for (path, vars) in &self.files {
            if let Some(v) = vars.get(name) {
                if !v.trim().is_empty() {
                    return Some((v.clone(), Source::DotEnv(path.clone(), name.to_string())));
                }
            }
        }
        None
    }

    pub fn value(&self, name: &str) -> Option<String> {
        self.get(name).map(|(v, _)| v)
    }

    /// Every variable the layers define, merged (for workload environments).
    pub fn merged(&self) -> BTreeMap<String, String> {
        let mut out = BTreeMap::new();
        for (_, vars) in self.files.iter().rev() {
            out.extend(vars.clone());
        }
        out.extend(self.process.clone());
        out
    }
}

/// Parses the python-dotenv dialect: `KEY=VALUE`, optional `export `, single quotes (literal),
/// double quotes (escapes `\n \t \" \\`, `${VAR}` expanded), unquoted values (trailing ` #`
/// comment dropped, `${VAR}` expanded), blank lines and `#` comments. `lookup` resolves
/// `${VAR}` against what is already known; variables defined earlier in the same file win.
pub fn parse_dotenv(
    text: &str,
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<BTreeMap<String, String>, SyntaxError> {
    let mut out = BTreeMap::new();
    for (i, raw) in text.lines().enumerate() {
        let line_no = i.saturating_add(1);
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let line = line
            .strip_prefix("export ")
            .map(str::trim_start)
            .unwrap_or(line);
        let Some((key, rest)) = line.split_once('=') else {
            return Err(SyntaxError {
                line: line_no,
                problem: Syntax::NoEquals(truncate(line, 40)),
            });
        };
        let key = key.trim();
        if key.is_empty()
            || !key
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.')
        {
            return Err(SyntaxError {
                line: line_no,
                problem: Syntax::BadName(truncate(key, 40)),
            });
        }
        let rest = rest.trim();
        let value = if let Some(inner) = rest.strip_prefix('\'') {
            let end = inner.find('\'').ok_or(SyntaxError {
                line: line_no,
                problem: Syntax::UnterminatedSingle,
            })?;
            inner[..end].to_string()
        } else if let Some(inner) = rest.strip_prefix('"') {
            let mut v = String::new();
            let mut chars = inner.chars();
            let mut closed = false;
            while let Some(c) = chars.next() {
                match c {
                    '"' => {
                        closed = true;
                        break;
                    }
                    '\\' => match chars.next() {
                        Some('n') => v.push('\n'),
                        Some('t') => v.push('\t'),
                        Some(o) => v.push(o),
                        None => {}
                    },
                    o => v.push(o),
                }
            }
            if !closed {
                return Err(SyntaxError {
                    line: line_no,
                    problem: Syntax::UnterminatedDouble,
                });
            }
            expand(&v, &out, &lookup)
        } else {
            let v = match rest.find(" #") {
                Some(pos) => rest[..pos].trim_end(),
                None => rest,
            };
            expand(v, &out, &lookup)
        };
        out.insert(key.to_string(), value);
    }
    Ok(out)
}

fn expand(
    v: &str,
    local: &BTreeMap<String, String>,
    lookup: &impl Fn(&str) -> Option<String>,
) -> String {
    let mut out = String::new();
    let mut rest = v;
    while let Some(start) = rest.find("${") {
        let (before, from) = rest.split_at_checked(start).unwrap_or((rest, ""));
        out.push_str(before);
        // `${` is two ASCII bytes, so `from.get(2..)` is on a char boundary.
        match from.get(2..).unwrap_or("").split_once('}') {
            Some((name, after)) => {
                let val = local
                    .get(name)
                    .cloned()
                    .or_else(|| lookup(name))
                    .unwrap_or_default();
                out.push_str(&val);
                rest = after;
            }
            None => {
                out.push_str(from);
                rest = "";
            }
        }
    }
    out.push_str(rest);
    out
}

fn truncate(s: &str, n: usize) -> String {
    s.chars().take(n).collect()
}

/// Parses a boolean the way every Cyberwave tool does: `1,true,t,yes,y,on` /
/// `0,false,f,no,n,off`, trimmed and case-insensitive.
pub fn parse_bool(v: &str) -> Option<bool> {
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "t" | "yes" | "y" | "on" => Some(true),
        "0" | "false" | "f" | "no" | "n" | "off" => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> BTreeMap<String, String> {
        parse_dotenv(text, |n| (n == "HOME").then(|| "/home/u".to_string())).unwrap()
    }

    #[test]
    fn parses_the_dotenv_dialect() {
        let m = parse(
            "# comment\n\nexport A=1\nB = two words # trailing\nC='lit ${HOME}'\nD=\"x\\ny ${A}\"\nE=${HOME}/d\nF=\n",
        );
        assert_eq!(m["A"], "1");
        assert_eq!(m["B"], "two words");
        assert_eq!(m["C"], "lit ${HOME}");
        assert_eq!(m["D"], "x\ny 1");
        assert_eq!(m["E"], "/home/u/d");
        assert_eq!(m["F"], "");
    }

    #[test]
    fn expands_odd_references_without_panicking() {
        let m = parse("A=${\nB=${}x\nC=é${HOME}é${A\nD=${${HOME}}\n");
        assert_eq!(m["A"], "${");
        assert_eq!(m["B"], "x");
        assert_eq!(m["C"], "é/home/ué${A");
        assert_eq!(m["D"], "}");
    }

    #[test]
    fn rejects_garbage_with_its_line() {
        let e = parse_dotenv("A=1\nnot a pair\n", |_| None).unwrap_err();
        assert_eq!(e.line, 2);
        let e = parse_dotenv("A=\"open\n", |_| None).unwrap_err();
        assert_eq!(e.line, 1);
    }

    #[test]
    fn layers_follow_documented_order() {
        let dir = std::env::temp_dir().join(format!("cw-env-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let local = dir.join("local.env");
        let shared = dir.join("shared.env");
        std::fs::write(&local, "T=local\nONLY_LOCAL=l\n").unwrap();
        std::fs::write(&shared, "T=shared\nONLY_SHARED=s\nP=shared\n").unwrap();
        let mut layers = EnvLayers::new([("P".to_string(), "process".to_string())].into());
        layers.add_dotenv(&local).unwrap();
        layers.add_dotenv(&shared).unwrap();
        layers.add_dotenv(&dir.join("missing.env")).unwrap();
        assert_eq!(
            layers.value("T").unwrap(),
            "local",
            "./.env beats the shared .env"
        );
        assert_eq!(
            layers.value("P").unwrap(),
            "process",
            "process env beats every file"
        );
        assert_eq!(layers.value("ONLY_SHARED").unwrap(), "s");
        assert!(matches!(layers.get("T").unwrap().1, Source::DotEnv(ref p, _) if p == &local));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn empty_process_value_counts_as_unset() {
        let layers = EnvLayers::new([("X".to_string(), " ".to_string())].into());
        assert!(layers.get("X").is_none());
    }

    #[test]
    fn bools() {
        for t in ["1", "TRUE", " yes ", "on", "t", "y"] {
            assert_eq!(parse_bool(t), Some(true), "{t}");
        }
        for f in ["0", "False", "no", "off", "f", "n"] {
            assert_eq!(parse_bool(f), Some(false), "{f}");
        }
        assert_eq!(parse_bool("maybe"), None);
    }
}
