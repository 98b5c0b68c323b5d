//! Every topic string the node uses, in one place. The prefix (from `CYBERWAVE_ENVIRONMENT`,
//! `production` = none) is glued on without a separator, for wire compatibility: `local` gives
//! `localcyberwave/…` (docs/protocol.md, "Topic prefix").

use super::commands::TopicId;

/// Whether `topic` may be published to (MQTT 3.1.1/5 §4.7): not empty, at most 65 535 bytes,
/// no wildcard and no NUL. A broker drops the connection of a client that publishes anything
/// else, so the node checks before it sends (D34).
pub fn publishable(topic: &str) -> bool {
    !topic.is_empty()
        && topic.len() <= 65_535
        && !topic.contains(['+', '#', '\0'])
        && topic.split('/').count() <= MAX_TOPIC_LEVELS
}

/// The deepest topic the node publishes to. Its own have fewer than 10 levels; mosquitto drops
/// a client that publishes to more than 200 (its default), so a deeper one (a planted or old
/// outbox entry) is set aside before it is sent rather than refused by the broker.
pub const MAX_TOPIC_LEVELS: usize = 100;

#[derive(Debug, Clone)]
pub struct Topics {
    prefix: String,
    client_id: String,
}

impl Topics {
    pub fn new(prefix: &str, client_id: &str) -> Topics {
        Topics {
            prefix: prefix.to_string(),
            client_id: client_id.to_string(),
        }
    }

    /// The node's MQTT client id: also the `session_id` its ingress events carry, as the SDK's
    /// publisher stamps its own client id on every payload.
    pub fn client_id(&self) -> &str {
        &self.client_id
    }

    /// The node's private inbox for request/response replies.
    pub fn inbox(&self) -> String {
        format!("{}cyberwave/response/{}", self.prefix, self.client_id)
    }

    /// R1. The API token is part of the topic name: wire-mandated (never logged).
    pub fn request_instance(&self, token: &str) -> String {
        format!(
            "{}cyberwave/cloud-node-token/{token}/request-instance",
            self.prefix
        )
    }

    fn node(&self, id: &str, leaf: &str) -> String {
        format!("{}cyberwave/cloud-node/{id}/{leaf}", self.prefix)
    }

    pub fn register(&self, uuid: &str) -> String {
        self.node(uuid, "register")
    }
    pub fn heartbeat(&self, uuid: &str) -> String {
        self.node(uuid, "heartbeat")
    }
    pub fn terminate(&self, uuid: &str) -> String {
        self.node(uuid, "terminate")
    }
    pub fn fail(&self, uuid: &str) -> String {
        self.node(uuid, "fail")
    }

    pub fn logs(&self, uuid: &str) -> String {
        self.node(uuid, "logs")
    }
    /// Commands arrive on `…/{uuid}/command` and `…/{slug}/command`.
    pub fn command(&self, uuid_or_slug: &str) -> String {
        self.node(uuid_or_slug, "command")
    }
    /// Whether `topic` is some node's command topic (`…/cloud-node/{id}/command`).
    pub fn is_command_topic(&self, topic: &str) -> bool {
        topic
            .strip_prefix(&self.prefix)
            .and_then(|t| t.strip_prefix("cyberwave/cloud-node/"))
            .and_then(|t| t.strip_suffix("/command"))
            .is_some_and(|id| !id.is_empty() && !id.contains('/'))
    }

    /// Command replies go to `…/{uuid}/response`.
    pub fn reply(&self, uuid: &str) -> String {
        self.node(uuid, "response")
    }
    /// R9. A workload topic takes only a [`TopicId`] (D20): a raw string cannot reach one.
    pub fn signed_url(&self, workload_uuid: &TopicId) -> String {
        format!(
            "{}cyberwave/cloud-workload/{workload_uuid}/request-signed-url",
            self.prefix
        )
    }

    /// R10.
    pub fn upload_results(&self, workload_uuid: &TopicId) -> String {
        format!(
            "{}cyberwave/cloud-workload/{workload_uuid}/upload-results",
            self.prefix
        )
    }

    /// R7/R8.
    pub fn workload_status(&self, workload_uuid: &TopicId) -> String {
        format!(
            "{}cyberwave/cloud-workload/{workload_uuid}/update-status",
            self.prefix
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_is_glued_without_separator() {
        let t = Topics::new("local", "cloud_node_1");
        assert_eq!(t.command("u"), "localcyberwave/cloud-node/u/command");
        assert_eq!(t.inbox(), "localcyberwave/response/cloud_node_1");
        assert_eq!(
            t.workload_status(&TopicId::new("t", "w").unwrap()),
            "localcyberwave/cloud-workload/w/update-status"
        );
        let t = Topics::new("", "c");
        assert_eq!(t.reply("u"), "cyberwave/cloud-node/u/response");
        assert_eq!(
            t.request_instance("cw_x"),
            "cyberwave/cloud-node-token/cw_x/request-instance"
        );
    }
}
