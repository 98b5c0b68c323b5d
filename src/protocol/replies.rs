//! The backend's replies to the node's MQTT requests, typed once at the edge: past
//! this module no code probes a reply's JSON for `success`, `code` or ids. Ids that become part
//! of a topic (`uuid`, `slug`) are kept only when they are topic-safe (D20): a hostile backend
//! cannot subscribe the node to a wildcard.

use serde_json::Value;

use super::commands::TopicId;

/// One reply, as the node uses it.
#[derive(Debug, Clone, PartialEq)]
pub struct Reply {
    /// `success: true`; anything else (absent, not a boolean) is a refusal.
    pub success: bool,
    /// The backend's error code, when it sent a whole number.
    pub code: Option<i64>,
    /// The backend's message (outside text: show it with `logtext::shown`).
    pub message: String,
    pub uuid: Option<TopicId>,
    pub slug: Option<TopicId>,
    /// The whole body, for the replies whose other fields a part reads itself (signed URLs).
    pub body: Value,
}

impl Reply {
    /// Any payload: not JSON, or not an object, is a refusal with no code.
    pub fn parse(payload: &[u8]) -> Reply {
        Reply::from_value(serde_json::from_slice(payload).unwrap_or(Value::Null))
    }

    pub fn from_value(body: Value) -> Reply {
        let id = |k: &str| {
            body.get(k)
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
                .and_then(|s| TopicId::new(k, s).ok())
        };
        Reply {
            success: body
                .get("success")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            code: body.get("code").and_then(Value::as_i64),
            message: body
                .get("message")
                .and_then(Value::as_str)
                .unwrap_or("no message")
                .to_string(),
            uuid: id("uuid"),
            slug: id("slug"),
            body,
        }
    }

    /// The backend says this instance no longer exists (404, or 400 naming its termination;
    /// decision D5).
    pub fn instance_gone(&self) -> bool {
        self.code == Some(404)
            || (self.code == Some(400) && self.message.to_lowercase().contains("terminat"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn replies_are_typed_and_hostile_ones_are_refusals() {
        let r = Reply::parse(br#"{"success":true,"uuid":"u-1","slug":"s"}"#);
        assert!(r.success);
        assert_eq!(r.uuid.map(|u| u.as_str().to_string()), Some("u-1".into()));
        for bad in [
            &b"not json"[..],
            b"[]",
            b"null",
            br#"{"success":"true"}"#,
            br#"{"success":1}"#,
        ] {
            let r = Reply::parse(bad);
            assert!(!r.success, "{:?}", String::from_utf8_lossy(bad));
            assert_eq!(r.code, None);
        }
        let r = Reply::from_value(json!({"success": false, "code": 404, "message": "gone"}));
        assert!(r.instance_gone());
        let r = Reply::from_value(json!({"code": 400, "message": "Instance TERMINATED"}));
        assert!(r.instance_gone());
        let r = Reply::from_value(json!({"code": 400, "message": "bad"}));
        assert!(!r.instance_gone());
        let r = Reply::from_value(json!({"code": 1e300, "message": 5}));
        assert_eq!((r.code, r.message.as_str()), (None, "no message"));
        // Ids that would be topic wildcards are dropped.
        let r = Reply::from_value(json!({"success": true, "uuid": "a/#", "slug": "+"}));
        assert_eq!((r.uuid, r.slug), (None, None));
    }
}
