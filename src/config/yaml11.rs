//! YAML as the platform reads it: PyYAML's `safe_load`, i.e. YAML 1.1 scalar resolution.
//!
//! `yaml-rust2` does the syntax (events with line numbers, scalar styles and tags); this module
//! builds the document from those events with the rules of PyYAML's `SafeLoader`: plain scalars
//! resolve as YAML 1.1 does (`yes`/`no`/`on`/`off` are booleans, `0x1F`, `017`, `1_000` and
//! `1:30` are integers, `2024-01-01` is a date, `1.0e+3` is a float but `1e3` is a string),
//! merge keys `<<` are flattened, and a duplicate key keeps its last value (with a note).
//! Quoted scalars are always strings.
//!
//! Outside input is bounded: aliases share the node they point at (a "billion laughs" file
//! costs its own size, never the expanded size), nesting deeper than [`MAX_DEPTH`] is refused,
//! and nothing here recurses over the document.

use std::collections::HashMap;
use std::rc::Rc;

use yaml_rust2::parser::{Event, Parser, Tag};
use yaml_rust2::scanner::TScalarStyle;

/// Deepest nesting accepted. PyYAML's recursive composer gives up (RecursionError) somewhere
/// in the hundreds; a manifest needs three levels.
pub const MAX_DEPTH: usize = 100;

/// Most entries merge keys may copy in one document: `<<: [*big, *big, …]` repeated would
/// otherwise cost the square of the file's size.
pub const MAX_MERGED_ENTRIES: usize = 1_000_000;

/// A resolved scalar, with the Python type PyYAML would have produced.
#[derive(Debug, Clone, PartialEq)]
pub enum Scalar {
    Null,
    Bool(bool),
    /// An integer; `None` when it does not fit in an `i128` (Python ints do not overflow).
    Int(Option<i128>),
    Float(f64),
    Str(String),
    /// `!!timestamp` or a plain `2024-01-01`: a Python date/datetime.
    Timestamp,
    /// `!!binary`, `!!set`, `!!omap`, `!!pairs`: types no manifest field takes.
    Other(&'static str),
}

/// A mapping's entries: keys in first-seen order, each with its last value.
pub type Entries = Vec<(Rc<Node>, Rc<Node>)>;

#[derive(Debug)]
pub enum Value {
    Scalar(Scalar),
    Seq(Vec<Rc<Node>>),
    /// Keys in first-seen order, each with its last value (Python dict semantics).
    Map(Vec<(Rc<Node>, Rc<Node>)>),
}

#[derive(Debug)]
pub struct Node {
    pub value: Value,
    /// 1-based line where the node starts.
    pub line: usize,
    /// The scalar as written (for messages and for "use the text as written").
    pub text: String,
    /// A plain, untagged `<<`: PyYAML's merge key.
    merge: bool,
}

impl Node {
    pub fn scalar(&self) -> Option<&Scalar> {
        match &self.value {
            Value::Scalar(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match &self.value {
            Value::Scalar(Scalar::Str(s)) => Some(s),
            _ => None,
        }
    }
    pub fn is_null(&self) -> bool {
        matches!(self.value, Value::Scalar(Scalar::Null))
    }
    pub fn map(&self) -> Option<&[(Rc<Node>, Rc<Node>)]> {
        match &self.value {
            Value::Map(m) => Some(m),
            _ => None,
        }
    }
    /// The value under a string key.
    pub fn get(&self, key: &str) -> Option<&Rc<Node>> {
        self.map()?
            .iter()
            .find(|(k, _)| k.as_str() == Some(key))
            .map(|(_, v)| v)
    }
    /// Whether Python would find this value false (`safe_load(f) or {}`).
    pub fn is_falsy(&self) -> bool {
        match &self.value {
            Value::Scalar(Scalar::Null) => true,
            Value::Scalar(Scalar::Bool(b)) => !b,
            Value::Scalar(Scalar::Int(n)) => *n == Some(0),
            Value::Scalar(Scalar::Float(f)) => *f == 0.0,
            Value::Scalar(Scalar::Str(s)) => s.is_empty(),
            Value::Scalar(_) => false,
            Value::Seq(s) => s.is_empty(),
            Value::Map(m) => m.is_empty(),
        }
    }
    /// A short description for messages ("the string \"x\"", "a list", …).
    pub fn describe(&self) -> String {
        match &self.value {
            Value::Scalar(Scalar::Null) => "null".into(),
            Value::Scalar(Scalar::Bool(b)) => {
                format!("the boolean {b} (written `{}`)", short(&self.text))
            }
            Value::Scalar(Scalar::Int(_)) => format!("the integer {}", short(&self.text)),
            Value::Scalar(Scalar::Float(_)) => format!("the number {}", short(&self.text)),
            Value::Scalar(Scalar::Str(s)) => format!("the string {:?}", short(s)),
            Value::Scalar(Scalar::Timestamp) => format!("the date {}", short(&self.text)),
            Value::Scalar(Scalar::Other(kind)) => format!("a {kind} value"),
            Value::Seq(_) => "a list".into(),
            Value::Map(_) => "a mapping".into(),
        }
    }
}

fn short(s: &str) -> String {
    let mut out: String = s.chars().take(40).collect();
    if s.chars().nth(40).is_some() {
        out.push('…');
    }
    out
}

/// Something the loader noticed.
#[derive(Debug, Clone, PartialEq)]
pub struct Note {
    pub line: usize,
    pub message: String,
    /// PyYAML would refuse the whole file for this (the node carries on).
    pub platform_error: bool,
}

/// A document that could not be read at all.
#[derive(Debug, Clone, PartialEq)]
pub struct Fatal {
    pub line: usize,
    pub message: String,
}

/// Reads the first document of `text`. `Ok(None)`: an empty stream.
pub fn load(text: &str) -> Result<(Option<Rc<Node>>, Vec<Note>), Fatal> {
    if let Some((line, c)) = non_printable(text) {
        return Err(Fatal {
            line,
            message: format!(
                "the file holds a control character (U+{:04X}) that YAML does not allow",
                u32::from(c)
            ),
        });
    }
    let mut b = Builder::default();
    let mut parser = Parser::new_from_str(text);
    let mut documents = 0usize;
    loop {
        let (ev, mark) = parser.next_token().map_err(|e| Fatal {
            line: e.marker().line().max(1),
            message: match e.info() {
                "recursion limit exceeded" => format!("nested deeper than {MAX_DEPTH} levels"),
                other => other.to_string(),
            },
        })?;
        let line = mark.line().max(1);
        match ev {
            Event::StreamEnd => break,
            Event::DocumentStart => {
                documents = documents.saturating_add(1);
                if documents > 1 {
                    b.notes.push(Note {
                        line,
                        message: "a second YAML document (after `---`); only the first is read"
                            .into(),
                        platform_error: true,
                    });
                    break;
                }
            }
            other => b.event(other, line)?,
        }
    }
    Ok((b.root, b.notes))
}

enum Frame {
    Seq {
        anchor: usize,
        line: usize,
        items: Vec<Rc<Node>>,
    },
    Map {
        anchor: usize,
        line: usize,
        entries: Vec<(Rc<Node>, Rc<Node>)>,
        pending_key: Option<Rc<Node>>,
    },
}

#[derive(Default)]
struct Builder {
    merged_entries: usize,
    stack: Vec<Frame>,
    anchors: HashMap<usize, Rc<Node>>,
    root: Option<Rc<Node>>,
    notes: Vec<Note>,
}

impl Builder {
    fn event(&mut self, ev: Event, line: usize) -> Result<(), Fatal> {
        match ev {
            Event::Scalar(text, style, anchor, tag) => {
                let merge = text == "<<" && style == TScalarStyle::Plain && tag.is_none();
                let value = self.scalar(&text, style, tag.as_ref(), line);
                let node = Rc::new(Node {
                    value: Value::Scalar(value),
                    line,
                    text,
                    merge,
                });
                if anchor > 0 {
                    self.anchors.insert(anchor, node.clone());
                }
                self.push(node);
            }
            Event::Alias(id) => {
                let node = self.anchors.get(&id).cloned().ok_or(Fatal {
                    line,
                    message: "an alias to an unknown anchor".into(),
                })?;
                self.push(node);
            }
            Event::SequenceStart(anchor, ref tag) | Event::MappingStart(anchor, ref tag) => {
                if self.stack.len() >= MAX_DEPTH {
                    return Err(Fatal {
                        line,
                        message: format!("nested deeper than {MAX_DEPTH} levels"),
                    });
                }
                let is_seq = matches!(ev, Event::SequenceStart(..));
                if let Some(t) = tag.as_ref() {
                    self.collection_tag(t, is_seq, line);
                }
                self.stack.push(if is_seq {
                    Frame::Seq {
                        anchor,
                        line,
                        items: Vec::new(),
                    }
                } else {
                    Frame::Map {
                        anchor,
                        line,
                        entries: Vec::new(),
                        pending_key: None,
                    }
                });
            }
            Event::SequenceEnd | Event::MappingEnd => {
                let node = match self.stack.pop() {
                    Some(Frame::Seq {
                        anchor,
                        line,
                        items,
                    }) => (
                        anchor,
                        Node {
                            value: Value::Seq(items),
                            line,
                            text: String::new(),
                            merge: false,
                        },
                    ),
                    Some(Frame::Map {
                        anchor,
                        line,
                        entries,
                        ..
                    }) => (
                        anchor,
                        Node {
                            value: Value::Map(self.flatten(entries, line)?),
                            line,
                            text: String::new(),
                            merge: false,
                        },
                    ),
                    None => return Ok(()),
                };
                let (anchor, node) = (node.0, Rc::new(node.1));
                if anchor > 0 {
                    self.anchors.insert(anchor, node.clone());
                }
                self.push(node);
            }
            _ => {}
        }
        Ok(())
    }

    fn push(&mut self, node: Rc<Node>) {
        match self.stack.last_mut() {
            None => {
                if self.root.is_none() {
                    self.root = Some(node);
                }
            }
            Some(Frame::Seq { items, .. }) => items.push(node),
            Some(Frame::Map {
                entries,
                pending_key,
                ..
            }) => match pending_key.take() {
                None => *pending_key = Some(node),
                Some(k) => entries.push((k, node)),
            },
        }
    }

    fn collection_tag(&mut self, tag: &Tag, is_seq: bool, line: usize) {
        let known = tag.handle == "tag:yaml.org,2002:"
            && match tag.suffix.as_str() {
                "seq" | "omap" | "pairs" => is_seq,
                "map" | "set" => !is_seq,
                _ => false,
            };
        if !known {
            self.notes.push(Note {
                line,
                message: format!(
                    "unknown tag `{}{}` (the node ignores it)",
                    tag_handle(tag),
                    tag.suffix
                ),
                platform_error: true,
            });
        }
    }

    fn scalar(
        &mut self,
        text: &str,
        style: TScalarStyle,
        tag: Option<&Tag>,
        line: usize,
    ) -> Scalar {
        let plain = style == TScalarStyle::Plain;
        let Some(tag) = tag else {
            return if plain {
                resolve_plain(text)
            } else {
                Scalar::Str(text.to_string())
            };
        };
        let std_tag = (tag.handle == "tag:yaml.org,2002:").then_some(tag.suffix.as_str());
        let resolved = match std_tag {
            Some("str") => Some(Scalar::Str(text.to_string())),
            Some("null") => Some(Scalar::Null),
            Some("bool") => match resolve_plain(text) {
                b @ Scalar::Bool(_) => Some(b),
                _ => None,
            },
            Some("int") => match resolve_plain(text) {
                i @ Scalar::Int(_) => Some(i),
                _ => None,
            },
            Some("float") => match resolve_plain(text) {
                f @ Scalar::Float(_) => Some(f),
                Scalar::Int(Some(n)) => Some(Scalar::Float(n as f64)),
                _ => text.trim().parse::<f64>().ok().map(Scalar::Float),
            },
            Some("timestamp") => Some(Scalar::Timestamp),
            Some("binary") => Some(Scalar::Other("binary")),
            // `!` alone: the non-specific tag, a string.
            None if tag.handle == "!" && tag.suffix.is_empty() => {
                Some(Scalar::Str(text.to_string()))
            }
            _ => {
                self.notes.push(Note {
                    line,
                    message: format!(
                        "unknown tag `{}{}` (the node reads the value as if untagged)",
                        tag_handle(tag),
                        tag.suffix
                    ),
                    platform_error: true,
                });
                return if plain {
                    resolve_plain(text)
                } else {
                    Scalar::Str(text.to_string())
                };
            }
        };
        resolved.unwrap_or_else(|| {
            self.notes.push(Note {
                line,
                message: format!(
                    "`{text}` is not a valid !!{} (the node reads it as a string)",
                    tag.suffix
                ),
                platform_error: true,
            });
            Scalar::Str(text.to_string())
        })
    }

    /// PyYAML's `flatten_mapping` and dict construction: the mappings named by `<<` come first
    /// (within a list, later ones win, as in PyYAML 6.0.4), then the explicit keys; a later duplicate replaces
    /// the value and keeps the first position.
    fn flatten(
        &mut self,
        entries: Vec<(Rc<Node>, Rc<Node>)>,
        line: usize,
    ) -> Result<Entries, Fatal> {
        let mut merged: Vec<(Rc<Node>, Rc<Node>)> = Vec::new();
        let mut explicit = Vec::with_capacity(entries.len());
        for (k, v) in entries {
            if !k.merge {
                explicit.push((k, v));
                continue;
            }
            match &v.value {
                Value::Map(m) => merged.extend(m.iter().cloned()),
                Value::Seq(items) => {
                    let mut parts = Vec::new();
                    for item in items {
                        match &item.value {
                            Value::Map(m) => parts.push(m),
                            _ => self.notes.push(Note {
                                line: item.line,
                                message: "`<<` lists something that is not a mapping; ignored"
                                    .into(),
                                platform_error: true,
                            }),
                        }
                    }
                    // PyYAML 6.0.4 (what the SDK installs) lets the later mapping of the list
                    // win for every key longer than one character; older PyYAML let the
                    // earlier one win. We follow the installed platform.
                    for m in parts {
                        merged.extend(m.iter().cloned());
                    }
                }
                Value::Scalar(_) => self.notes.push(Note {
                    line: k.line,
                    message: "`<<` must name a mapping or a list of mappings; ignored".into(),
                    platform_error: true,
                }),
            }
        }
        let merged_len = merged.len();
        self.merged_entries = self.merged_entries.saturating_add(merged_len);
        if self.merged_entries > MAX_MERGED_ENTRIES {
            return Err(Fatal {
                line,
                message: format!("merge keys (`<<`) copy more than {MAX_MERGED_ENTRIES} entries"),
            });
        }
        let mut out: Vec<(Rc<Node>, Rc<Node>)> = Vec::new();
        let mut explicit_at: Vec<bool> = Vec::new();
        let mut index: HashMap<String, usize> = HashMap::new();
        for (i, (k, v)) in merged.into_iter().chain(explicit).enumerate() {
            let is_explicit = i >= merged_len;
            let Some(canon) = canonical_key(&k) else {
                self.notes.push(Note {
                    line: k.line,
                    message: format!("{} cannot be a key; ignored", k.describe()),
                    platform_error: true,
                });
                continue;
            };
            match index.get(&canon).copied() {
                Some(at) => {
                    // Two explicit keys deserve a warning; an explicit key over a merged one
                    // is what `<<` is for.
                    if is_explicit && explicit_at.get(at).copied().unwrap_or(false) {
                        let first_line = out.get(at).map(|(f, _)| f.line).unwrap_or(0);
                        self.notes.push(Note {
                            line: k.line,
                            message: format!(
                                "duplicate key `{}` (also on line {first_line}); the last one wins",
                                short(&k.text)
                            ),
                            platform_error: false,
                        });
                    }
                    if let Some(slot) = out.get_mut(at) {
                        slot.1 = v;
                    }
                    if let Some(e) = explicit_at.get_mut(at) {
                        *e = *e || is_explicit;
                    }
                }
                None => {
                    index.insert(canon, out.len());
                    out.push((k, v));
                    explicit_at.push(is_explicit);
                }
            }
        }
        Ok(out)
    }
}

fn tag_handle(tag: &Tag) -> &str {
    if tag.handle == "tag:yaml.org,2002:" {
        "!!"
    } else {
        &tag.handle
    }
}

/// A key's identity as a Python dict sees it: `1`, `1.0` and `true` are the same key.
fn canonical_key(k: &Node) -> Option<String> {
    match &k.value {
        Value::Scalar(Scalar::Str(s)) => Some(format!("s:{s}")),
        Value::Scalar(Scalar::Null) => Some("z".into()),
        Value::Scalar(Scalar::Bool(b)) => Some(format!("n:{}", u8::from(*b))),
        Value::Scalar(Scalar::Int(Some(n))) => Some(format!("n:{n}")),
        Value::Scalar(Scalar::Int(None)) => Some(format!("N:{}", k.text)),
        Value::Scalar(Scalar::Float(f)) => {
            if f.fract() == 0.0 && f.abs() < 1e30 {
                Some(format!("n:{}", *f as i128))
            } else {
                Some(format!("f:{}", f.to_bits()))
            }
        }
        Value::Scalar(Scalar::Timestamp) => Some(format!("t:{}", k.text)),
        Value::Scalar(Scalar::Other(_)) | Value::Seq(_) | Value::Map(_) => None,
    }
}

/// PyYAML's implicit resolvers (YAML 1.1) for a plain scalar.
pub fn resolve_plain(t: &str) -> Scalar {
    match t {
        "" | "~" | "null" | "Null" | "NULL" => return Scalar::Null,
        "yes" | "Yes" | "YES" | "true" | "True" | "TRUE" | "on" | "On" | "ON" => {
            return Scalar::Bool(true)
        }
        "no" | "No" | "NO" | "false" | "False" | "FALSE" | "off" | "Off" | "OFF" => {
            return Scalar::Bool(false)
        }
        _ => {}
    }
    if let Some(n) = yaml11_int(t) {
        return Scalar::Int(n);
    }
    if let Some(f) = yaml11_float(t) {
        return Scalar::Float(f);
    }
    if is_timestamp(t) {
        return Scalar::Timestamp;
    }
    Scalar::Str(t.to_string())
}

fn split_sign(t: &str) -> (bool, &str) {
    if let Some(r) = t.strip_prefix('-') {
        (true, r)
    } else if let Some(r) = t.strip_prefix('+') {
        (false, r)
    } else {
        (false, t)
    }
}

/// Digits of `radix` and `_`, at least one character: the value, `Some(None)` on overflow.
fn digits(s: &str, radix: u32) -> Option<Option<i128>> {
    if s.is_empty() {
        return None;
    }
    let mut n: Option<i128> = Some(0);
    for c in s.chars() {
        if c == '_' {
            continue;
        }
        let d = c.to_digit(radix)?;
        n = n
            .and_then(|n| n.checked_mul(i128::from(radix)))
            .and_then(|n| n.checked_add(i128::from(d)));
    }
    Some(n)
}

/// `Some(value)` when `t` is a YAML 1.1 int (`Some(None)`: too large for an i128).
fn yaml11_int(t: &str) -> Option<Option<i128>> {
    let (neg, body) = split_sign(t);
    let apply = |n: Option<i128>| {
        if neg {
            n.and_then(i128::checked_neg)
        } else {
            n
        }
    };
    if let Some(b) = body.strip_prefix("0b") {
        return digits(b, 2).map(apply);
    }
    if let Some(h) = body.strip_prefix("0x") {
        return digits(h, 16).map(apply);
    }
    if body == "0" {
        return Some(Some(0));
    }
    if let Some(o) = body.strip_prefix('0') {
        return digits(o, 8).map(apply);
    }
    let first = body.chars().next()?;
    if !('1'..='9').contains(&first) {
        return None;
    }
    if body.contains(':') {
        // Sexagesimal: 1:30 = 90; every part after the first is [0-5]?[0-9].
        let mut parts = body.split(':');
        let head = digits(parts.next()?, 10)?;
        let mut n = head;
        for p in parts {
            if p.is_empty() || p.len() > 2 || !p.chars().all(|c| c.is_ascii_digit()) {
                return None;
            }
            if p.len() == 2 && !p.starts_with(|c: char| ('0'..='5').contains(&c)) {
                return None;
            }
            let d = digits(p, 10)?;
            n = n
                .and_then(|n| n.checked_mul(60))
                .and_then(|n| d.and_then(|d| n.checked_add(d)));
        }
        return Some(apply(n));
    }
    digits(body, 10).map(apply)
}

fn yaml11_float(t: &str) -> Option<f64> {
    match t {
        ".inf" | ".Inf" | ".INF" | "+.inf" | "+.Inf" | "+.INF" => return Some(f64::INFINITY),
        "-.inf" | "-.Inf" | "-.INF" => return Some(f64::NEG_INFINITY),
        ".nan" | ".NaN" | ".NAN" => return Some(f64::NAN),
        _ => {}
    }
    let (neg, body) = split_sign(t);
    let sign = if neg { -1.0 } else { 1.0 };
    if body.contains(':') {
        // Sexagesimal float: [0-9][0-9_]*(:[0-5]?[0-9])+\.[0-9_]*
        let (whole, frac) = body.split_once('.')?;
        if !frac.chars().all(|c| c.is_ascii_digit() || c == '_') {
            return None;
        }
        let n = match yaml11_int(whole)? {
            Some(n) => n as f64,
            None => return None,
        };
        let f: f64 = format!("0.{}", frac.replace('_', "")).parse().ok()?;
        return Some(sign * (n + f));
    }
    // [0-9][0-9_]*\.[0-9_]*([eE][-+][0-9]+)?  or  \.[0-9][0-9_]*([eE][-+][0-9]+)?
    let (mantissa, exp) = match body.find(['e', 'E']) {
        Some(i) => (body.get(..i)?, Some(body.get(i.saturating_add(1)..)?)),
        None => (body, None),
    };
    let (whole, frac) = mantissa.split_once('.')?;
    let ok_digits = |s: &str| s.chars().all(|c| c.is_ascii_digit() || c == '_');
    if whole.is_empty() {
        if neg || t.starts_with('+') || !frac.starts_with(|c: char| c.is_ascii_digit()) {
            return None;
        }
    } else if !whole.starts_with(|c: char| c.is_ascii_digit()) || !ok_digits(whole) {
        return None;
    }
    if !ok_digits(frac) {
        return None;
    }
    if let Some(e) = exp {
        let digits_part = e.strip_prefix(['-', '+'])?;
        if digits_part.is_empty() || !digits_part.chars().all(|c| c.is_ascii_digit()) {
            return None;
        }
    }
    let cleaned = format!(
        "{}{}",
        if neg { "-" } else { "" },
        mantissa.replace('_', "")
    );
    let cleaned = match exp {
        Some(e) => format!("{cleaned}e{e}"),
        None => cleaned,
    };
    cleaned.parse::<f64>().ok()
}

/// `YYYY-MM-DD`, or a date-time with `T`/spaces, optional fraction and zone.
fn is_timestamp(t: &str) -> bool {
    let b = t.as_bytes();
    let d = |i: usize| b.get(i).is_some_and(u8::is_ascii_digit);
    if b.len() == 10
        && (0..4).all(d)
        && b.get(4) == Some(&b'-')
        && d(5)
        && d(6)
        && b.get(7) == Some(&b'-')
        && d(8)
        && d(9)
    {
        return true;
    }
    // The long form: YYYY-M(M)-D(D)(T|spaces)H(H):MM:SS(.f*)?( *(Z|±H(H)(:MM)?))?
    if !((0..4).all(d) && b.get(4) == Some(&b'-')) {
        return false;
    }
    let rest = t.get(5..).unwrap_or("");
    let Some((date_rest, time)) = rest.split_once(['T', 't', ' ', '\t']) else {
        return false;
    };
    let mut dp = date_rest.split('-');
    let one_or_two = |s: Option<&str>| {
        s.is_some_and(|s| (1..=2).contains(&s.len()) && s.chars().all(|c| c.is_ascii_digit()))
    };
    if !(one_or_two(dp.next()) && one_or_two(dp.next()) && dp.next().is_none()) {
        return false;
    }
    let time = time.trim_start_matches([' ', '\t']);
    let mut tp = time.splitn(3, ':');
    let (h, m, s) = (tp.next(), tp.next(), tp.next());
    if !one_or_two(h) || !m.is_some_and(|m| m.len() == 2 && m.chars().all(|c| c.is_ascii_digit())) {
        return false;
    }
    let Some(s) = s else { return false };
    let sec_end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    if sec_end != 2 {
        return false;
    }
    let mut tail = s.get(2..).unwrap_or("");
    if let Some(f) = tail.strip_prefix('.') {
        let end = f.find(|c: char| !c.is_ascii_digit()).unwrap_or(f.len());
        tail = f.get(end..).unwrap_or("");
    }
    let tail = tail.trim_start_matches([' ', '\t']);
    if tail.is_empty() || tail == "Z" {
        return true;
    }
    let Some(z) = tail.strip_prefix(['+', '-']) else {
        return false;
    };
    let (zh, zm) = match z.split_once(':') {
        Some((h, m)) => (h, Some(m)),
        None => (z, None),
    };
    one_or_two(Some(zh)) && zm.is_none_or(|m| m.len() == 2 && m.chars().all(|c| c.is_ascii_digit()))
}

/// The first character PyYAML's reader refuses, with its line.
fn non_printable(text: &str) -> Option<(usize, char)> {
    let mut line = 1usize;
    for c in text.chars() {
        if c == '\n' {
            line = line.saturating_add(1);
        }
        let ok = matches!(c, '\t' | '\n' | '\r' | '\u{20}'..='\u{7E}' | '\u{85}' | '\u{A0}'..='\u{D7FF}' | '\u{E000}'..='\u{FFFD}' | '\u{10000}'..='\u{10FFFF}');
        if !ok {
            return Some((line, c));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root(text: &str) -> Rc<Node> {
        load(text).unwrap().0.unwrap()
    }

    #[test]
    fn plain_scalars_resolve_as_yaml_1_1() {
        for (t, want) in [
            ("yes", Scalar::Bool(true)),
            ("Off", Scalar::Bool(false)),
            ("y", Scalar::Str("y".into())),
            ("n", Scalar::Str("n".into())),
            ("~", Scalar::Null),
            ("", Scalar::Null),
            ("0x1E", Scalar::Int(Some(30))),
            ("017", Scalar::Int(Some(15))),
            ("08", Scalar::Str("08".into())),
            ("0b101", Scalar::Int(Some(5))),
            ("1_000", Scalar::Int(Some(1000))),
            ("-1:30", Scalar::Int(Some(-90))),
            ("1:30:00", Scalar::Int(Some(5400))),
            ("1:60", Scalar::Str("1:60".into())),
            ("1e3", Scalar::Str("1e3".into())),
            ("1.0e+3", Scalar::Float(1000.0)),
            ("1.0e3", Scalar::Str("1.0e3".into())),
            ("1.", Scalar::Float(1.0)),
            (".5", Scalar::Float(0.5)),
            ("-.inf", Scalar::Float(f64::NEG_INFINITY)),
            ("2024-01-01", Scalar::Timestamp),
            ("2001-12-14t21:59:43.10-05:00", Scalar::Timestamp),
            ("2001-12-14", Scalar::Timestamp),
            ("2001-12-1", Scalar::Str("2001-12-1".into())),
            ("<<", Scalar::Str("<<".into())),
            (
                "99999999999999999999999999999999999999999",
                Scalar::Int(None),
            ),
        ] {
            assert_eq!(resolve_plain(t), want, "{t:?}");
        }
        assert!(matches!(resolve_plain(".NaN"), Scalar::Float(f) if f.is_nan()));
    }

    #[test]
    fn quoted_scalars_stay_strings_and_lines_are_kept() {
        let r = root("a: 'yes'\nb: \"1\"\nc: yes\n");
        assert_eq!(r.get("a").unwrap().as_str(), Some("yes"));
        assert_eq!(r.get("b").unwrap().as_str(), Some("1"));
        let c = r.get("c").unwrap();
        assert_eq!(c.scalar(), Some(&Scalar::Bool(true)));
        assert_eq!(c.line, 3);
    }

    #[test]
    fn merge_keys_follow_pyyaml_precedence() {
        let r = root(
            "a: &a {xx: a, y: a}\nb: &b {xx: b, z: b}\nm:\n  <<: [*a, *b]\n  y: own\n  <<: {w: later}\n",
        );
        let m = r.get("m").unwrap();
        let v = |k: &str| m.get(k).and_then(|n| n.as_str().map(String::from));
        assert_eq!(
            v("xx").as_deref(),
            Some("b"),
            "the later mapping in the list wins (PyYAML 6.0.4)"
        );
        assert_eq!(v("y").as_deref(), Some("own"), "explicit keys win");
        assert_eq!(v("z").as_deref(), Some("b"));
        assert_eq!(v("w").as_deref(), Some("later"));
        assert!(m.get("<<").is_none());
    }

    #[test]
    fn duplicates_keep_the_last_value_with_a_note() {
        let (r, notes) = load("k: 1\nj: 2\nk: 3\n").unwrap();
        let r = r.unwrap();
        assert_eq!(r.get("k").unwrap().scalar(), Some(&Scalar::Int(Some(3))));
        assert_eq!(r.map().unwrap().len(), 2);
        assert_eq!(notes.len(), 1);
        assert_eq!(notes[0].line, 3);
        assert!(!notes[0].platform_error);
        // 1, 1.0 and true are one key, as in a Python dict.
        let (r, notes) = load("1: a\ntrue: b\n1.0: c\n").unwrap();
        assert_eq!(r.unwrap().map().unwrap().len(), 1);
        assert_eq!(notes.len(), 2);
    }

    #[test]
    fn hostile_input_is_bounded() {
        // Billion laughs: aliases share nodes, nothing is expanded.
        let mut text = String::from("a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n");
        for i in 1..40 {
            let p = i - 1;
            text.push_str(&format!(
                "a{i}: &a{i} [*a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}]\n"
            ));
        }
        assert!(load(&text).is_ok());
        // The same through merge keys: bounded work, then a clean error.
        let mut text = String::from("m0: &m0 {");
        text.push_str(
            &(0..1000)
                .map(|i| format!("k{i}: {i}"))
                .collect::<Vec<_>>()
                .join(", "),
        );
        text.push_str("}\n");
        for i in 1..20 {
            let refs = vec![format!("*m{}", i - 1); 200].join(", ");
            text.push_str(&format!("m{i}: &m{i} {{<<: [{refs}]}}\n"));
        }
        let e = load(&text).unwrap_err();
        assert!(e.message.contains("merge keys"), "{e:?}");
        // Deep nesting: a clean error, no stack overflow.
        let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        assert!(load(&deep).is_err());
        let deep_block: String = (0..300).map(|i| format!("{}k:\n", " ".repeat(i))).collect();
        assert!(load(&deep_block).is_err());
        // Control characters PyYAML refuses; unicode it accepts.
        let e = load("a: b\nc: \u{7}\n").unwrap_err();
        assert_eq!(e.line, 2);
        assert!(load("\u{540d}\u{524d}: \u{1F680}\n").is_ok());
        // Unknown tags and aliases to nowhere.
        let (_, notes) = load("a: !custom x\n").unwrap();
        assert!(notes[0].platform_error);
        assert!(load("a: *nowhere\n").is_err());
        // Unhashable keys are dropped with a note.
        let (r, notes) = load("? [a, b]\n: c\nd: e\n").unwrap();
        assert_eq!(r.unwrap().map().unwrap().len(), 1);
        assert!(notes[0].platform_error);
    }
}
