//! Sessions and discovery from the client side: profile files and the session and FindTools RPCs.

use std::path::Path;

use serde::Deserialize;
use toolsrv_proto::text::printable;
use toolsrv_proto::v1::{
    FindToolsRequest, FindToolsResponse, GetSessionRequest, ListSessionsRequest, LoadToolRequest,
    OpenSessionRequest, SessionProfile, SessionState, UnloadToolRequest,
};

use crate::{Client, ClientError};

/// Largest profile file read.
const MAX_PROFILE_BYTES: u64 = 1 << 20;

/// A session profile file: `{"autoLoad": ["tool", ...], "hosts": "SELECTOR", "maxLoaded": 40}`.
/// Every key is optional; an unknown key is an error (a misspelt `autoload` would otherwise load
/// nothing, silently).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Profile {
    /// Tools loaded when the session opens.
    #[serde(default)]
    pub auto_load: Vec<String>,
    /// Host selector; `all` when unset.
    #[serde(default)]
    pub hosts: Option<String>,
    /// Most tools loaded at once; 40 when unset.
    #[serde(default)]
    pub max_loaded: Option<u32>,
}

impl Profile {
    /// Reads a profile file, with errors naming the file and what is wrong.
    pub fn load(path: &Path) -> Result<Self, ClientError> {
        // The path and the JSON's words (an unknown key is quoted back) reach a terminal.
        let fail = |why: String| {
            ClientError::Profile(format!("{}: {why}", printable(&path.display().to_string())))
        };
        let file =
            toolsrv_tls::files::open_read(path).map_err(|e| fail(format!("cannot open: {e}")))?;
        let text = toolsrv_tls::files::read_text_up_to(file, MAX_PROFILE_BYTES)
            .map_err(|e| fail(format!("cannot read: {e}")))?
            .ok_or_else(|| fail(format!("over the limit of {MAX_PROFILE_BYTES} bytes")))?;
        Self::parse(&text).map_err(fail)
    }

    /// Parses a profile's JSON text.
    pub fn parse(text: &str) -> Result<Self, String> {
        // A struct also takes a JSON array, filled by position: `[["a"], "all", 1]` would be
        // read as a profile without a word about it.
        if !text.trim_start().starts_with('{') {
            return Err(
                "a profile is a JSON object: {\"autoLoad\": [\"tool\", ...], \"hosts\": \
                 \"SELECTOR\", \"maxLoaded\": 40}"
                    .to_string(),
            );
        }
        // serde quotes an unknown key back: its escape sequences must not reach a terminal.
        let profile: Self = serde_json::from_str(text).map_err(|e| printable(&e.to_string()))?;
        if profile.max_loaded == Some(0) {
            return Err("maxLoaded must be at least 1".to_string());
        }
        Ok(profile)
    }

    /// The profile as the coordinator takes it.
    pub fn to_proto(&self) -> SessionProfile {
        SessionProfile {
            auto_load: self.auto_load.clone(),
            hosts: self.hosts.clone().unwrap_or_default(),
            max_loaded: self.max_loaded.unwrap_or(0),
        }
    }
}

/// A session's state updates: the state now, then one per change; endless until dropped or
/// the session ends (an error then).
#[derive(Debug)]
pub struct SessionWatch {
    inner: tonic::Streaming<SessionState>,
}

impl SessionWatch {
    /// The next state; `None` when the coordinator ended the stream cleanly (shutting down).
    pub async fn next(&mut self) -> Option<Result<SessionState, ClientError>> {
        match self.inner.message().await {
            Ok(Some(state)) => Some(Ok(state)),
            Ok(None) => None,
            Err(status) => Some(Err(status.into())),
        }
    }
}

impl Client {
    /// Ranks the tools visible on the online hosts `selector` picks against `query`.
    pub async fn find_tools(
        &self,
        selector: &str,
        query: &str,
        limit: u32,
    ) -> Result<FindToolsResponse, ClientError> {
        let request = FindToolsRequest {
            selector: selector.to_string(),
            query: query.to_string(),
            limit,
        };
        Ok(self.inner.clone().find_tools(request).await?.into_inner())
    }

    /// Opens a session; `hosts`, when given, replaces the profile's selector.
    pub async fn open_session(
        &self,
        profile: &Profile,
        hosts: Option<&str>,
    ) -> Result<SessionState, ClientError> {
        let request = OpenSessionRequest {
            profile: Some(profile.to_proto()),
            hosts: hosts.unwrap_or_default().to_string(),
        };
        Ok(self.inner.clone().open_session(request).await?.into_inner())
    }

    /// Loads `tool` into session `id` (the seed's `tool_load`).
    pub async fn load_tool(&self, id: &str, tool: &str) -> Result<SessionState, ClientError> {
        let request = LoadToolRequest {
            session: id.to_string(),
            tool: tool.to_string(),
        };
        Ok(self.inner.clone().load_tool(request).await?.into_inner())
    }

    /// Unloads `tool` from session `id`.
    pub async fn unload_tool(&self, id: &str, tool: &str) -> Result<SessionState, ClientError> {
        let request = UnloadToolRequest {
            session: id.to_string(),
            tool: tool.to_string(),
        };
        Ok(self.inner.clone().unload_tool(request).await?.into_inner())
    }

    /// Session `id`'s state now.
    pub async fn session(&self, id: &str) -> Result<SessionState, ClientError> {
        let request = GetSessionRequest {
            session: id.to_string(),
        };
        Ok(self.inner.clone().get_session(request).await?.into_inner())
    }

    /// Watches session `id`: its state now and after every change. The session does not end
    /// while a watch is open.
    pub async fn watch_session(&self, id: &str) -> Result<SessionWatch, ClientError> {
        let request = GetSessionRequest {
            session: id.to_string(),
        };
        let inner = self
            .inner
            .clone()
            .watch_session(request)
            .await?
            .into_inner();
        Ok(SessionWatch { inner })
    }

    /// This client's open sessions (on every replica that answers in time), sorted by id.
    pub async fn sessions(&self) -> Result<Vec<SessionState>, ClientError> {
        let request = ListSessionsRequest {};
        Ok(self
            .inner
            .clone()
            .list_sessions(request)
            .await?
            .into_inner()
            .sessions)
    }

    /// Ends session `id` now.
    pub async fn close_session(&self, id: &str) -> Result<(), ClientError> {
        let request = GetSessionRequest {
            session: id.to_string(),
        };
        self.inner.clone().close_session(request).await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_profile_is_a_json_object_of_known_fields() {
        let profile =
            Profile::parse(r#" {"autoLoad": ["disk_usage"], "hosts": "role=web", "maxLoaded": 3}"#)
                .unwrap();
        assert_eq!(profile.auto_load, ["disk_usage"]);
        assert_eq!(profile.hosts.as_deref(), Some("role=web"));
        assert_eq!(profile.max_loaded, Some(3));
        assert!(Profile::parse("{}").unwrap().auto_load.is_empty());
        for (text, expect) in [
            (
                r#"[["disk_usage"], "local", 1]"#,
                "a profile is a JSON object",
            ),
            (r#"[["disk_usage"]]"#, "a profile is a JSON object"),
            ("\"disk_usage\"", "a profile is a JSON object"),
            ("", "a profile is a JSON object"),
            (r#"{"autoload": []}"#, "unknown field `autoload`"),
            (r#"{"maxLoaded": 0}"#, "maxLoaded must be at least 1"),
            (r#"{"maxLoaded": -1}"#, "invalid value"),
            (r#"{"autoLoad": "disk_usage"}"#, "invalid type"),
        ] {
            let e = Profile::parse(text).unwrap_err();
            assert!(e.contains(expect), "{text}: {e}");
        }
    }

    /// A profile's unknown key and its file's name are quoted back on a terminal: their escape
    /// sequences come back escaped, not run.
    #[test]
    fn profile_errors_show_control_characters_escaped() {
        let e = Profile::parse(r#"{"autoLoad":[],"\u001b]0;PWNED\u0007\u001b[2J":1}"#).unwrap_err();
        assert!(
            e.contains(r"unknown field `\u{1b}]0;PWNED\u{7}\u{1b}[2J`"),
            "{e}"
        );
        assert!(!e.chars().any(toolsrv_proto::text::disguises), "{e:?}");

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hostile\u{1b}[2J.json");
        std::fs::write(&path, "{\"maxLoaded\": 0}").unwrap();
        let e = Profile::load(&path).unwrap_err().to_string();
        assert!(e.contains(r"hostile\u{1b}[2J.json: maxLoaded"), "{e}");
        let e = Profile::load(&dir.path().join("gone\u{7}"))
            .unwrap_err()
            .to_string();
        assert!(e.contains(r"gone\u{7}: cannot open"), "{e}");
        assert!(!e.chars().any(toolsrv_proto::text::disguises), "{e:?}");
    }
}
