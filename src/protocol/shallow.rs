//! A shallow scan of a command that could not be parsed whole (over the size limit, nested too
//! deep, not JSON), so that it still gets its error reply and, when it named a workload, a
//! `failed` status (D64). It reads only the members of the top-level object (`request_id`,
//! `command`, `status`) and of its `params` object (`workload_uuid`); every other value is
//! skipped with a depth counter, never parsed and never recursed into, so any nesting costs
//! one pass over the bytes and no stack. A string that is read is decoded by serde_json, token
//! by token.
//!
//! What it cannot read soundly it leaves out: a member named twice (which value is meant?), a
//! request id that is not a string or a number or is longer than the protocol allows, a
//! workload uuid that is not a topic-safe id. Text that ends early (a truncated message) gives
//! what was read before the end.

use serde_json::Value;

use super::ids::{workload_id, Kind, TopicId, MAX_REQUEST_ID_BYTES};

/// What the scan read of a command.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Head {
    /// The request id, a string or a number, when it was there once.
    pub request_id: Option<Value>,
    /// The workload a start (or `workload_received`) names in its params, when it was there
    /// once and is a topic-safe id.
    pub workload_uuid: Option<TopicId>,
    /// A top-level `status` member: the echo of a reply, ignored like any echo.
    pub echo: bool,
}

/// One member the scan looks for: not seen, seen once with this value, or seen more than once.
#[derive(Debug, Default, Clone, PartialEq)]
enum Once<T> {
    #[default]
    Unseen,
    Seen(Option<T>),
    Repeated,
}

impl<T> Once<T> {
    fn see(&mut self, v: Option<T>) {
        *self = match self {
            Once::Unseen => Once::Seen(v),
            _ => Once::Repeated,
        };
    }

    fn get(self) -> Option<T> {
        match self {
            Once::Seen(v) => v,
            _ => None,
        }
    }
}

/// The longest member name worth decoding: every name looked for fits, even with each of its
/// characters written as a `\u00XX` escape.
const MAX_NAME_TOKEN: usize = 96;
/// The longest `command` token worth decoding.
const MAX_COMMAND_TOKEN: usize = 256;
/// The longest workload uuid token (256 bytes, each perhaps escaped in six).
const MAX_UUID_TOKEN: usize = 6 * 256 + 2;

/// Reads what it can of the command's envelope; see the module's comment.
pub fn scan(bytes: &[u8]) -> Head {
    let mut s = Scanner { bytes, at: 0 };
    let mut request_id = Once::Unseen;
    let mut command: Once<String> = Once::Unseen;
    let mut workload = Once::Unseen;
    let mut echo = false;
    // Ends early (and keeps what was read) at the first thing that is not JSON.
    let _ = s.object(|s, name| {
        match name.as_deref() {
            Some("request_id") => request_id.see(s.request_id()),
            Some("command") => command.see(s.string(MAX_COMMAND_TOKEN)),
            Some("params") => workload.see(s.params_workload()),
            Some("status") => {
                echo = true;
                s.skip_value();
            }
            _ => s.skip_value(),
        }
        Some(())
    });
    let starts = command
        .get()
        .is_some_and(|c| Kind::parse(&c).is_some() || c == "workload_received");
    Head {
        request_id: request_id.get(),
        workload_uuid: workload.get().filter(|_| starts),
        echo,
    }
}

struct Scanner<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Scanner<'_> {
    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.at).copied()
    }

    fn bump(&mut self) {
        self.at = self.at.saturating_add(1).min(self.bytes.len());
    }

    fn ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.bump();
        }
    }

    fn eat(&mut self, b: u8) -> Option<()> {
        self.ws();
        (self.peek() == Some(b)).then(|| self.bump())
    }

    /// The members of an object, each handed to `member` with its name (when short enough to
    /// be one looked for) and the scanner at its value. `None` where the text stops being JSON.
    fn object(
        &mut self,
        mut member: impl FnMut(&mut Self, Option<String>) -> Option<()>,
    ) -> Option<()> {
        self.eat(b'{')?;
        self.ws();
        if self.peek() == Some(b'}') {
            self.bump();
            return Some(());
        }
        loop {
            self.ws();
            let name = self.string(MAX_NAME_TOKEN);
            self.eat(b':')?;
            self.ws();
            member(self, name)?;
            self.ws();
            match self.peek()? {
                b',' => self.bump(),
                b'}' => {
                    self.bump();
                    return Some(());
                }
                _ => return None,
            }
        }
    }

    /// The end of the string token that starts here (after its closing quote).
    fn string_end(&self) -> Option<usize> {
        if self.peek() != Some(b'"') {
            return None;
        }
        let rest = self.bytes.get(self.at.saturating_add(1)..)?;
        let mut i = 0usize;
        loop {
            let p = memchr::memchr2(b'"', b'\\', rest.get(i..)?)?;
            let q = i.saturating_add(p);
            if rest.get(q) == Some(&b'\\') {
                i = q.saturating_add(2); // the escaped character, whatever it is
            } else {
                return Some(self.at.saturating_add(q).saturating_add(2));
            }
        }
    }

    /// The string here, decoded, when its token is at most `max` bytes long; the scanner moves
    /// past the token either way (to the end of the text when it is not closed).
    fn string(&mut self, max: usize) -> Option<String> {
        if self.peek() != Some(b'"') {
            self.skip_value();
            return None;
        }
        let end = self.string_end();
        let token = end.and_then(|e| self.bytes.get(self.at..e));
        self.at = end.unwrap_or(self.bytes.len());
        serde_json::from_slice(token.filter(|t| t.len() <= max)?).ok()
    }

    /// A request id: a string of at most [`MAX_REQUEST_ID_BYTES`] or a number; anything else
    /// is skipped and reads as none.
    fn request_id(&mut self) -> Option<Value> {
        match self.peek()? {
            b'"' => {
                let s = self.string(MAX_REQUEST_ID_BYTES.saturating_mul(6).saturating_add(2))?;
                (s.len() <= MAX_REQUEST_ID_BYTES).then_some(Value::String(s))
            }
            b'-' | b'0'..=b'9' => {
                let start = self.at;
                self.skip_value();
                let token = self.bytes.get(start..self.at)?;
                match serde_json::from_slice(token).ok()? {
                    n @ Value::Number(_) => Some(n),
                    _ => None,
                }
            }
            _ => {
                self.skip_value();
                None
            }
        }
    }

    /// The `workload_uuid` of a `params` object, once; anything but an object reads as none.
    fn params_workload(&mut self) -> Option<TopicId> {
        if self.peek() != Some(b'{') {
            self.skip_value();
            return None;
        }
        let mut uuid = Once::Unseen;
        // Cut short, the params still give what was read before the end.
        let _ = self.object(|s, name| {
            if name.as_deref() == Some("workload_uuid") {
                let v = s.string(MAX_UUID_TOKEN);
                uuid.see(v);
            } else {
                s.skip_value();
            }
            Some(())
        });
        workload_id(uuid.get()).and_then(|t| TopicId::new("params.workload_uuid", &t).ok())
    }

    /// Moves past one value of any kind and depth, without parsing it: strings by their
    /// quotes, objects and arrays by a depth counter, anything else up to the next delimiter.
    fn skip_value(&mut self) {
        match self.peek() {
            Some(b'"') => self.at = self.string_end().unwrap_or(self.bytes.len()),
            Some(b'{' | b'[') => self.skip_nested(),
            _ => {
                while let Some(b) = self.peek() {
                    if matches!(b, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r') {
                        break;
                    }
                    self.bump();
                }
            }
        }
    }

    fn skip_nested(&mut self) {
        let mut depth: u64 = 0;
        while let Some(b) = self.peek() {
            match b {
                b'"' => {
                    self.at = self.string_end().unwrap_or(self.bytes.len());
                    continue;
                }
                b'{' | b'[' => depth = depth.saturating_add(1),
                b'}' | b']' => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        self.bump();
                        return;
                    }
                }
                _ => {}
            }
            self.bump();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn rid(text: &[u8]) -> Option<Value> {
        scan(text).request_id
    }

    fn wl(text: &[u8]) -> Option<String> {
        scan(text).workload_uuid.map(|t| t.as_str().to_string())
    }

    #[test]
    fn truncated_json_gives_what_was_read_before_the_end() {
        let full = br#"{"request_id":"r-1","command":"inference","params":{"workload_uuid":"wl-1","x":[1,2,3]}}"#;
        for cut in 0..full.len() {
            let head = scan(&full[..cut]);
            // Never a value that was not in the text, whatever the cut.
            if let Some(r) = &head.request_id {
                assert_eq!(r, &json!("r-1"), "cut at {cut}");
            }
            if let Some(w) = &head.workload_uuid {
                assert_eq!(w.as_str(), "wl-1", "cut at {cut}");
            }
        }
        assert_eq!(rid(br#"{"request_id":"r-1","comm"#), Some(json!("r-1")));
        assert_eq!(rid(br#"{"request_id":"r-1"#), None, "an unclosed string");
        assert_eq!(rid(br#"{"request_id":12"#), Some(json!(12)));
        // The workload counts only for a start, so the command must have been read.
        assert_eq!(
            wl(br#"{"command":"training","params":{"workload_uuid":"wl-1","x":[[[["#),
            Some("wl-1".into())
        );
        assert_eq!(wl(br#"{"params":{"workload_uuid":"wl-1","#), None);
        assert_eq!(scan(b""), Head::default());
        assert_eq!(scan(b"   "), Head::default());
    }

    #[test]
    fn a_member_named_twice_is_not_read() {
        assert_eq!(rid(br#"{"request_id":"a","request_id":"b"}"#), None);
        assert_eq!(rid(br#"{"request_id":"a","request_id":"a"}"#), None);
        assert_eq!(
            wl(br#"{"command":"inference","params":{"workload_uuid":"a","workload_uuid":"b"}}"#),
            None
        );
        assert_eq!(
            wl(br#"{"command":"inference","params":{"workload_uuid":"a"},"params":{}}"#),
            None
        );
        assert_eq!(
            wl(br#"{"command":"inference","command":"status","params":{"workload_uuid":"a"}}"#),
            None
        );
        // Nested deeper, the same name is another member: it does not count.
        assert_eq!(
            rid(br#"{"x":{"request_id":"inner"},"request_id":"outer"}"#),
            Some(json!("outer"))
        );
        assert_eq!(rid(br#"{"x":{"request_id":"inner"}}"#), None);
    }

    #[test]
    fn a_request_id_of_the_wrong_type_or_size_is_not_read() {
        for bad in [
            &br#"{"request_id":{"a":1}}"#[..],
            br#"{"request_id":["r"]}"#,
            br#"{"request_id":true}"#,
            br#"{"request_id":null}"#,
            br#"{"request_id":1e999}"#,
            br#"{"request_id":12abc}"#,
            br#"{"request_id":"\ud800"}"#,
            b"{\"request_id\":\"\xff\"}",
        ] {
            assert_eq!(rid(bad), None, "{}", String::from_utf8_lossy(bad));
        }
        let long = format!(
            r#"{{"request_id":"{}"}}"#,
            "x".repeat(MAX_REQUEST_ID_BYTES + 1)
        );
        assert_eq!(rid(long.as_bytes()), None);
        let fits = format!(r#"{{"request_id":"{}"}}"#, "x".repeat(MAX_REQUEST_ID_BYTES));
        assert!(rid(fits.as_bytes()).is_some());
        assert_eq!(rid(br#"{"request_id":-1.5}"#), Some(json!(-1.5)));
    }

    #[test]
    fn strings_with_escapes_are_decoded_and_their_quotes_do_not_end_them() {
        assert_eq!(
            rid(br#"{"x":"a\"b\\","request_id":"r\"\n\u00e9"}"#),
            Some(json!("r\"\n\u{e9}"))
        );
        // A name written with escapes is the same name.
        assert_eq!(
            rid(br#"{"request\u005fid":"r"}"#),
            Some(json!("r")),
            "an escaped name"
        );
        // A quote inside a skipped string does not end it.
        assert_eq!(
            rid(br#"{"x":"}\"{\"request_id\":\"forged\"","request_id":"real"}"#),
            Some(json!("real"))
        );
        assert_eq!(
            rid(br#"{"x":["\"]","request_id"],"request_id":"real"}"#),
            Some(json!("real"))
        );
        // A trailing backslash at the very end ends nothing.
        assert_eq!(rid(br#"{"request_id":"r\"#), None);
    }

    #[test]
    fn nesting_of_any_depth_is_skipped_in_one_pass() {
        let depth = 32 << 20;
        let mut text =
            br#"{"request_id":"deep","command":"simulate","params":{"workload_uuid":"wl-d","x":"#
                .to_vec();
        text.extend(std::iter::repeat_n(b'[', depth));
        text.extend(std::iter::repeat_n(b']', depth));
        text.extend(b"}}");
        let head = scan(&text);
        assert_eq!(head.request_id, Some(json!("deep")));
        assert_eq!(
            head.workload_uuid.map(|t| t.as_str().to_string()),
            Some("wl-d".into())
        );
        // Unclosed: the scan ends at the end of the text.
        let mut open = br#"{"x":"#.to_vec();
        open.extend(std::iter::repeat_n(b'{', depth));
        assert_eq!(scan(&open), Head::default());
        // The members after a deep value are read too.
        let mut after = br#"{"x":"#.to_vec();
        after.extend(std::iter::repeat_n(b'[', 1000));
        after.extend(std::iter::repeat_n(b']', 1000));
        after.extend(br#","request_id":7}"#);
        assert_eq!(rid(&after), Some(json!(7)));
    }

    #[test]
    fn the_workload_is_read_only_for_a_start_and_only_when_topic_safe() {
        let with = |cmd: &str, uuid: &str| {
            let text = format!(r#"{{"command":{cmd},"params":{{"workload_uuid":{uuid}}}}}"#);
            wl(text.as_bytes())
        };
        for start in [
            "\"inference\"",
            "\"simulate\"",
            "\"training\"",
            "\"workload_received\"",
        ] {
            assert_eq!(with(start, "\"wl-1\""), Some("wl-1".into()), "{start}");
        }
        for other in ["\"cancel\"", "\"status\"", "\"bogus\"", "5", "null"] {
            assert_eq!(with(other, "\"wl-1\""), None, "{other}");
        }
        for bad in [
            "\"a/b\"",
            "\"a+b\"",
            "\"#\"",
            "\"\"",
            "\"None\"",
            "\"a b\"",
            "\"\\u0000\"",
            "7",
            "{}",
            "null",
        ] {
            assert_eq!(with("\"inference\"", bad), None, "{bad}");
        }
        let long = format!("\"{}\"", "w".repeat(257));
        assert_eq!(with("\"inference\"", &long), None);
        // Params that are not an object name no workload.
        assert_eq!(wl(br#"{"command":"inference","params":"wl-1"}"#), None);
    }

    #[test]
    fn an_echo_is_recognised_and_anything_but_an_object_reads_as_nothing() {
        assert!(scan(br#"{"status":"ok","request_id":"r"}"#).echo);
        assert!(!scan(br#"{"x":{"status":"ok"}}"#).echo);
        for not in [
            &b"[1,2]"[..],
            b"\"s\"",
            b"12",
            b"null",
            b"}",
            b"{,}",
            b"{\"a\" 1}",
            b"\xff\xfe",
        ] {
            assert_eq!(
                scan(not),
                Head::default(),
                "{}",
                String::from_utf8_lossy(not)
            );
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic_and_never_invent_a_value() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let alphabet: &[&[u8]] = &[
            b"{",
            b"}",
            b"[",
            b"]",
            b"\"",
            b"\\",
            b":",
            b",",
            b" ",
            b"request_id",
            b"params",
            b"workload_uuid",
            b"command",
            b"\"inference\"",
            b"\"r\"",
            b"1",
            b"\xff",
            b"u00",
        ];
        for _ in 0..20_000 {
            let mut text = Vec::new();
            for _ in 0..(x % 40) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                text.extend_from_slice(alphabet[(x % alphabet.len() as u64) as usize]);
            }
            let head = scan(&text);
            if let Some(Value::String(s)) = &head.request_id {
                assert!(s.len() <= MAX_REQUEST_ID_BYTES);
            }
            if let Some(w) = head.workload_uuid {
                assert!(!w.as_str().is_empty());
            }
        }
    }
}
