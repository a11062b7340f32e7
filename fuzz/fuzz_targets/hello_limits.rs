//! What an agent's hello and an operator's host-labels file may carry: any bytes decoded as an
//! agent message are refused or accepted without a panic, and an accepted hello is within every
//! documented bound (no control characters, bounded labels and fields); any text given as a
//! host-labels file parses or is refused with a message.
#![no_main]

use libfuzzer_sys::fuzz_target;
use prost::Message;
use toolsrv_coordinator::labels::{self, HostLabels, MAX_FIELD, MAX_LABEL_KEY, MAX_LABELS};
use toolsrv_proto::v1::{AgentMessage, agent_message};

fuzz_target!(|data: &[u8]| {
    if let Ok(AgentMessage {
        msg: Some(agent_message::Msg::Hello(hello)),
    }) = AgentMessage::decode(data)
        && labels::check_hello(&hello).is_ok()
    {
        let clean = |s: &str| s.len() <= MAX_FIELD && !s.chars().any(char::is_control);
        assert!(clean(&hello.agent_version));
        if let Some(facts) = &hello.facts {
            assert!([&facts.os, &facts.arch, &facts.hostname, &facts.kernel]
                .iter()
                .all(|s| clean(s)));
            assert!(facts.labels.len() <= MAX_LABELS);
            for (k, v) in &facts.labels {
                assert!(!k.is_empty() && k.len() <= MAX_LABEL_KEY && clean(k) && clean(v));
            }
        }
    }
    if let Ok(text) = std::str::from_utf8(data)
        && let Ok(labels) = HostLabels::parse(text)
    {
        // Lookups on a parsed file never panic, whatever the host id.
        let _ = labels.of(text);
    }
});
