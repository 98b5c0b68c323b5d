//! The ids and names a command carries, defined once for the full parse of a command
//! ([`super::commands`]) and for the shallow scan of one that cannot be parsed whole
//! ([`super::shallow`]): the request id's limit, topic-safe ids, the workload kinds, and the
//! error a field that does not validate gives.

use std::fmt;

use serde::Serialize;

/// `request_id` may be at most this long (D20); a longer one is refused.
pub const MAX_REQUEST_ID_BYTES: usize = 16 * 1024;
/// Ids that reach a topic (D20).
pub const MAX_ID_BYTES: usize = 256;

/// A field that did not validate: the reply names the field and what is allowed
/// (`params.pid must be …`). An empty field means the reason is a whole sentence.
#[derive(Debug, Clone, PartialEq)]
pub struct FieldError {
    pub field: String,
    pub reason: String,
    /// The reason is a whole sentence (the Python original's wording): shown alone.
    pub sentence: bool,
}

impl FieldError {
    pub(super) fn new(field: &str, reason: impl Into<String>) -> FieldError {
        FieldError {
            field: field.to_string(),
            reason: reason.into(),
            sentence: false,
        }
    }

    pub(super) fn sentence(field: &str, text: impl Into<String>) -> FieldError {
        FieldError {
            sentence: true,
            ..FieldError::new(field, text)
        }
    }
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.sentence {
            f.write_str(&self.reason)
        } else {
            write!(f, "{} {}", self.field, self.reason)
        }
    }
}

/// What a Python sender writes for a missing workload id (`str(None)`): no workload topic is
/// ever `…/None/…` (R7–R10).
pub(super) const NO_WORKLOAD: &str = "None";

/// A workload id as it is read from a command, a workload's record or a note of a start:
/// `None` when it is absent, empty or the text `"None"`. Parsed here, where the value enters,
/// so that nothing past the edge compares with that text.
pub fn workload_id(s: Option<String>) -> Option<String> {
    s.filter(|u| !u.is_empty() && u != NO_WORKLOAD)
}

/// An id that may be part of an MQTT topic (D20): 1 to 256 bytes of printable ASCII without
/// `+`, `#`, `/` or whitespace.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TopicId(String);

impl TopicId {
    pub fn new(field: &str, s: &str) -> Result<TopicId, FieldError> {
        if s.is_empty() || s.len() > MAX_ID_BYTES {
            return Err(FieldError::new(
                field,
                format!(
                    "must be 1 to {MAX_ID_BYTES} bytes long (it is {} bytes)",
                    s.len()
                ),
            ));
        }
        if let Some(c) = s
            .chars()
            .find(|c| !c.is_ascii_graphic() || matches!(c, '+' | '#' | '/'))
        {
            return Err(FieldError::new(
                field,
                format!(
                    "may hold only printable ASCII without '+', '#', '/' or whitespace (found {})",
                    c.escape_default()
                ),
            ));
        }
        Ok(TopicId(s.to_string()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Read as the text it is (it validated itself when it was made).
impl std::ops::Deref for TopicId {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

/// Written as the string it is.
impl Serialize for TopicId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl fmt::Display for TopicId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The workload kinds a start can name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Inference,
    Simulate,
    Training,
}

impl Kind {
    pub fn parse(s: &str) -> Option<Kind> {
        match s {
            "inference" => Some(Kind::Inference),
            "simulate" => Some(Kind::Simulate),
            "training" => Some(Kind::Training),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Inference => "inference",
            Kind::Simulate => "simulate",
            Kind::Training => "training",
        }
    }
}
