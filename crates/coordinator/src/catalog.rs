//! Turning registry catalogs into the updates shipped to agents: full first, incremental after.

use std::sync::Arc;

use toolsrv_proto::v1::{BlobRef, CatalogUpdate, ToolDocument};
use toolsrv_registry::Catalog;

/// Most `.meta` bytes per update message; a larger catalog goes out as several messages.
/// Small on purpose: each message is held whole while queued and written, and the agent's stream
/// decoder keeps a buffer as large as the largest message it received, for the life of the link
/// (a single larger `.meta` still goes out whole).
const BATCH_BYTES: usize = 16 << 10;

/// Catalogs a link remembers having shipped, to check the views its agent reports against the
/// one each was computed from: an agent answers an update with a view, and one more update may
/// be on its way meanwhile, so a few suffice; a view of an older one is followed by a newer.
const SHIPPED_KEPT: usize = 4;

/// What one agent was sent: the catalog it was brought up to last, and the few before it, shared
/// with every link sent the same ones (a link keeps pointers, not lists as long as the catalog).
#[derive(Debug, Default)]
pub struct Shipped {
    last: Option<Arc<Catalog>>,
    before: std::collections::VecDeque<Arc<Catalog>>,
}

impl Shipped {
    /// The catalog of `revision`, if it is the last one shipped or one of the few before it.
    pub fn catalog(&self, revision: u64) -> Option<&Arc<Catalog>> {
        self.last
            .iter()
            .chain(self.before.iter().rev())
            .find(|c| c.revision == revision)
    }

    /// The messages that bring the agent from what it was sent to `catalog`; empty when nothing changed.
    pub fn updates(&mut self, catalog: &Arc<Catalog>) -> Vec<CatalogUpdate> {
        if let Some(last) = self
            .last
            .as_ref()
            .filter(|c| c.revision != catalog.revision)
        {
            if self.before.len() == SHIPPED_KEPT - 1 {
                self.before.pop_front();
            }
            self.before.push_back(last.clone());
        }
        let previous = self.last.replace(catalog.clone());
        let full = previous.is_none();
        let previous = match previous {
            Some(p) if p.revision == catalog.revision => return Vec::new(),
            Some(p) => p,
            None => Arc::default(),
        };
        // A tool goes out again when its `.meta` or its executable changed.
        let upserts: Vec<ToolDocument> = catalog
            .tools
            .iter()
            .filter(|(name, tool)| {
                full || !previous
                    .tools
                    .get(*name)
                    .is_some_and(|was| was.same_content(tool))
            })
            .map(|(name, tool)| ToolDocument {
                name: name.clone(),
                meta: tool.bytes.to_vec(),
                meta_sha256: tool.digest.clone(),
                executable: tool.executable.as_ref().map(|e| BlobRef {
                    sha256: e.sha256.clone(),
                    size: e.size,
                }),
            })
            .collect();
        let removals: Vec<String> = previous
            .tools
            .keys()
            .filter(|name| !catalog.tools.contains_key(*name))
            .cloned()
            .collect();
        if !full && upserts.is_empty() && removals.is_empty() {
            return Vec::new();
        }
        batch(catalog.revision, full, upserts, removals)
    }
}

/// Splits an update into messages of bounded size (removals first, then upserts, about
/// [`BATCH_BYTES`] of names or `.meta` bytes each); only the first may be `full`, every one but
/// the last says `more`.
fn batch(
    revision: u64,
    full: bool,
    upserts: Vec<ToolDocument>,
    removals: Vec<String>,
) -> Vec<CatalogUpdate> {
    enum Item {
        Removal(String),
        Upsert(ToolDocument),
    }
    let part = |full| CatalogUpdate {
        revision,
        full,
        upserts: Vec::new(),
        removals: Vec::new(),
        more: false,
    };
    let mut out = vec![part(full)];
    let mut size = 0;
    let items = removals
        .into_iter()
        .map(Item::Removal)
        .chain(upserts.into_iter().map(Item::Upsert));
    for item in items {
        let bytes = match &item {
            Item::Removal(name) => name.len(),
            Item::Upsert(doc) => doc.meta.len(),
        };
        if size + bytes > BATCH_BYTES && size > 0 {
            if let Some(last) = out.last_mut() {
                last.more = true;
            }
            out.push(part(false));
            size = 0;
        }
        size += bytes;
        if let Some(last) = out.last_mut() {
            match item {
                Item::Removal(name) => last.removals.push(name),
                Item::Upsert(doc) => last.upserts.push(doc),
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use toolsrv_registry::Registry;

    fn names(u: &CatalogUpdate) -> Vec<&str> {
        u.upserts.iter().map(|d| d.name.as_str()).collect()
    }

    #[test]
    fn full_then_incremental() {
        let dir = tempfile::tempdir().unwrap();
        let write = |n: &str, d: &str| {
            std::fs::write(
                dir.path().join(format!("{n}.meta")),
                format!(r#"{{"description":"{d}"}}"#),
            )
            .unwrap()
        };
        write("a", "1");
        write("b", "1");
        let reg = Registry::open(vec![dir.path().into()]);
        let mut shipped = Shipped::default();
        let catalog = reg.catalog();
        let first = shipped.updates(&catalog);
        // The link keeps the catalog it was sent, not a copy of its names.
        assert!(Arc::ptr_eq(shipped.last.as_ref().unwrap(), &catalog));
        assert_eq!(first.len(), 1);
        assert!(first[0].full);
        assert_eq!(names(&first[0]), ["a", "b"]);
        assert!(
            shipped.updates(&reg.catalog()).is_empty(),
            "nothing changed"
        );

        write("b", "2");
        write("c", "1");
        std::fs::remove_file(dir.path().join("a.meta")).unwrap();
        reg.rescan();
        let next = shipped.updates(&reg.catalog());
        assert_eq!(next.len(), 1);
        assert!(!next[0].full);
        assert_eq!(names(&next[0]), ["b", "c"]);
        assert_eq!(next[0].removals, ["a"]);
        assert_eq!(next[0].revision, reg.catalog().revision);
    }

    #[test]
    fn the_last_few_catalogs_shipped_are_remembered() {
        let mut shipped = Shipped::default();
        let catalog = |revision| {
            Arc::new(Catalog {
                revision,
                ..Catalog::default()
            })
        };
        assert!(shipped.catalog(0).is_none());
        for revision in 1..=6 {
            shipped.updates(&catalog(revision));
            // The same revision again is not remembered twice.
            shipped.updates(&catalog(revision));
        }
        let kept: Vec<u64> = (0..=7).filter(|r| shipped.catalog(*r).is_some()).collect();
        assert_eq!(kept, (7 - SHIPPED_KEPT as u64..=6).collect::<Vec<_>>());
    }

    #[test]
    fn large_catalogs_are_split() {
        let docs: Vec<ToolDocument> = (0..10)
            .map(|i| ToolDocument {
                name: format!("t{i}"),
                meta: vec![b' '; 6 << 10],
                ..Default::default()
            })
            .collect();
        let out = batch(7, true, docs, vec!["gone".into()]);
        assert!(out.len() >= 3, "{} messages", out.len());
        assert!(out[0].full && out[1..].iter().all(|u| !u.full));
        let (last, parts) = out.split_last().unwrap();
        assert!(parts.iter().all(|u| u.more) && !last.more);
        assert!(out.iter().all(|u| u.revision == 7));
        assert_eq!(out.iter().map(|u| u.upserts.len()).sum::<usize>(), 10);
        assert!(
            out.iter()
                .all(|u| u.upserts.iter().map(|d| d.meta.len()).sum::<usize>() <= BATCH_BYTES)
        );
    }

    #[test]
    fn many_removals_are_split_too() {
        let removals: Vec<String> = (0..10_000).map(|i| format!("tool-{i:05}")).collect();
        let out = batch(3, false, Vec::new(), removals.clone());
        assert!(out.len() > 3, "{} messages", out.len());
        let (last, parts) = out.split_last().unwrap();
        assert!(parts.iter().all(|u| u.more) && !last.more);
        assert!(out.iter().all(|u| !u.full));
        assert!(out.iter().all(|u| u.removals.concat().len() <= BATCH_BYTES));
        let all: Vec<String> = out.into_iter().flat_map(|u| u.removals).collect();
        assert_eq!(all, removals);
    }
}
