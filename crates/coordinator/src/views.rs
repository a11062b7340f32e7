//! Host views as the coordinator keeps them: identical tool definitions are shared between hosts.
//!
//! Most hosts resolve most tools the same way, and a definition (prompt, schema) is by far the
//! largest part of a view; keeping one copy per distinct definition keeps memory per idle agent
//! small however large the catalog.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Mutex, Weak};

use prost::Message;
use toolsrv_proto::v1::{HostView, ToolDefinition, ToolStatus};

/// A host's view: tools sorted by name.
#[derive(Debug, Default)]
pub struct StoredView {
    pub catalog_revision: u64,
    pub tools: Vec<StoredTool>,
}

/// One tool of a host's view.
#[derive(Debug)]
pub struct StoredTool {
    pub name: String,
    pub visible: bool,
    pub variant: Option<u32>,
    pub reason: String,
    /// The listing description of a hidden tool (a visible one's is in its definition).
    hidden_description: String,
    pub definition: Option<Arc<ToolDefinition>>,
}

impl StoredTool {
    pub fn status(&self) -> ToolStatus {
        let description = match &self.definition {
            Some(def) if self.visible => def.description.clone(),
            _ => self.hidden_description.clone(),
        };
        ToolStatus {
            name: self.name.clone(),
            visible: self.visible,
            variant: self.variant,
            reason: self.reason.clone(),
            definition: self.definition.as_deref().cloned(),
            description,
        }
    }
}

impl StoredView {
    /// The tool named `name`, if the view has it.
    pub fn tool(&self, name: &str) -> Option<&StoredTool> {
        self.tools
            .binary_search_by(|t| t.name.as_str().cmp(name))
            .ok()
            .map(|i| &self.tools[i])
    }
}

/// Shares equal definitions. Entries die with the last view that uses them.
#[derive(Debug, Default)]
pub struct Interner {
    state: Mutex<InternState>,
}

#[derive(Debug, Default)]
struct InternState {
    hasher: RandomState,
    defs: HashMap<u64, Vec<Weak<ToolDefinition>>>,
    /// Size of `defs` after the last sweep of dead entries.
    swept_at: usize,
}

impl Interner {
    /// Stores an agent's view, sorting its tools and sharing its definitions.
    pub fn store(&self, view: HostView) -> StoredView {
        let mut tools: Vec<StoredTool> = view
            .tools
            .into_iter()
            .map(|t| StoredTool {
                definition: t.definition.map(|d| self.intern(d)),
                hidden_description: if t.visible {
                    String::new()
                } else {
                    t.description
                },
                name: t.name,
                visible: t.visible,
                variant: t.variant,
                reason: t.reason,
            })
            .collect();
        tools.sort_by(|a, b| a.name.cmp(&b.name));
        StoredView {
            catalog_revision: view.catalog_revision,
            tools,
        }
    }

    fn intern(&self, def: ToolDefinition) -> Arc<ToolDefinition> {
        // Entries only ever hold complete definitions, so a poisoned lock is still consistent.
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let key = state.hasher.hash_one(def.encode_to_vec());
        let bucket = state.defs.entry(key).or_default();
        if let Some(shared) = bucket.iter().filter_map(Weak::upgrade).find(|d| **d == def) {
            return shared;
        }
        bucket.retain(|w| w.strong_count() > 0);
        let shared = Arc::new(def);
        bucket.push(Arc::downgrade(&shared));
        if state.defs.len() > 2 * state.swept_at + 1024 {
            state.defs.retain(|_, bucket| {
                bucket.retain(|w| w.strong_count() > 0);
                !bucket.is_empty()
            });
            state.swept_at = state.defs.len();
        }
        shared
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(name: &str, visible: bool, prompt: &str) -> ToolStatus {
        ToolStatus {
            name: name.into(),
            visible,
            description: format!("{name} tool"),
            reason: if visible {
                String::new()
            } else {
                "no variant matches".into()
            },
            definition: visible.then(|| ToolDefinition {
                name: name.into(),
                description: format!("{name} tool"),
                prompt: prompt.into(),
                ..ToolDefinition::default()
            }),
            ..ToolStatus::default()
        }
    }

    #[test]
    fn equal_definitions_are_shared_and_views_round_trip() {
        let interner = Interner::default();
        let view = |prompt: &str| HostView {
            catalog_revision: 3,
            tools: vec![
                status("b", true, prompt),
                status("a", false, ""),
                status("c", true, "same"),
            ],
        };
        let one = interner.store(view("long prompt"));
        let two = interner.store(view("long prompt"));
        let other = interner.store(view("another prompt"));
        let (b1, b2, b3) = (
            one.tool("b").unwrap(),
            two.tool("b").unwrap(),
            other.tool("b").unwrap(),
        );
        assert!(Arc::ptr_eq(
            b1.definition.as_ref().unwrap(),
            b2.definition.as_ref().unwrap()
        ));
        assert!(!Arc::ptr_eq(
            b1.definition.as_ref().unwrap(),
            b3.definition.as_ref().unwrap()
        ));
        assert_eq!(
            one.tools
                .iter()
                .map(|t| t.name.as_str())
                .collect::<Vec<_>>(),
            ["a", "b", "c"]
        );
        assert_eq!(one.tool("a").unwrap().status(), status("a", false, ""));
        assert_eq!(
            one.tool("b").unwrap().status(),
            status("b", true, "long prompt")
        );
        assert!(one.tool("zz").is_none());
    }

    #[test]
    fn dead_definitions_are_swept() {
        let interner = Interner::default();
        for i in 0..5000 {
            drop(interner.store(HostView {
                catalog_revision: 1,
                tools: vec![status("t", true, &i.to_string())],
            }));
        }
        let live = interner.state.lock().unwrap().defs.len();
        assert!(live < 3000, "{live} entries kept for dead views");
    }
}
