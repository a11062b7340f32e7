//! What a message will take in memory once decoded, read from its encoded bytes before it is
//! decoded.
//!
//! A message's encoded size is limited ([`MAX_MESSAGE_BYTES`]), but not what decoding it makes:
//! an empty entry of a repeated field is two bytes on the wire and a whole struct once decoded.
//! 16 MiB of empty `HostView.tools` entries decoded to about 1.7 GB, and any peer could send
//! them: an agent on its link, a client in a request. Every receiver therefore walks the
//! encoded message along its schema first (the file descriptor set compiled into this crate)
//! and refuses it, undecoded, when what decoding would allocate exceeds [`MAX_DECODED_BYTES`].
//!
//! The count is an upper bound, not a measurement: every entry of a repeated field counts
//! twice the size of what it decodes to (a vector at most doubles what it holds), the first
//! four times and an allocation, the largest vector once more (while it grows, its old room is
//! held too), and three times in a struct decoded into before (a message field given again is
//! merged into what the first made); a map entry a share of a B-tree node; every non-empty string its length and an
//! allocation, four times that when its field was given before in the same message (decoding
//! grows the buffer it reuses), a bytes value once more (decoding copies it out first). A test
//! decodes messages of every hostile shape under a counting allocator and holds the bound above
//! what was allocated. Walking is cheap: the payload of a string or bytes field is skipped, not
//! read, so the cost is one step per field on the wire.

use std::collections::HashMap;
use std::fmt;
use std::sync::OnceLock;

use prost::Message as _;
use prost_types::field_descriptor_proto::{Label, Type};
use prost_types::{DescriptorProto, FileDescriptorSet};

use crate::limits::{MAX_DECODED_BYTES, MAX_MESSAGE_BYTES};

/// What one heap allocation costs beyond the bytes asked for (an allocator's header and
/// rounding); counted for every non-empty string or bytes value and every entry of a repeated
/// field.
const ALLOCATION_BYTES: usize = 32;

/// A B-tree node of a decoded `map<string, string>` (11 keys, 11 values, 12 edges).
const MAP_NODE_BYTES: usize = 11 * 2 * 32 + 12 * 8 + 32;

/// Deepest nesting of messages followed; the schema nests far less, and recursion in it would
/// otherwise be unbounded.
const MAX_DEPTH: usize = 32;

/// A message refused before decoding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    /// The message's full protobuf name, such as `toolsrv.v1.AgentMessage`.
    pub message: String,
    /// Its encoded size.
    pub encoded: usize,
    /// What is wrong with it.
    pub why: Why,
}

/// Why a message is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Why {
    /// Decoding it would allocate more than [`MAX_DECODED_BYTES`]; `field` is the path of the
    /// field whose entries crossed the limit, such as `view.tools`.
    TooLarge { field: String },
    /// Its bytes are not protobuf wire format, or nest deeper than any toolsrv message.
    Malformed { at: usize, what: &'static str },
}

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.why {
            Why::TooLarge { field } => write!(
                f,
                "a {} of {} bytes would take more than {} bytes of memory once decoded (the \
                 entries of its field `{field}`); refused before decoding",
                self.message, self.encoded, MAX_DECODED_BYTES
            ),
            Why::Malformed { at, what } => write!(
                f,
                "a {} of {} bytes cannot be read: {what} at byte {at}",
                self.message, self.encoded
            ),
        }
    }
}

impl std::error::Error for Refused {}

/// `OUT_OF_RANGE` for a message too large once decoded, `INTERNAL` (what a message that does
/// not decode gets) for one that is not wire format.
impl From<Refused> for tonic::Status {
    fn from(refused: Refused) -> Self {
        match refused.why {
            Why::TooLarge { .. } => Self::out_of_range(refused.to_string()),
            Why::Malformed { .. } => Self::internal(refused.to_string()),
        }
    }
}

/// Refuses `encoded`, a `M` as it came off the wire, when decoding it would allocate more than
/// [`MAX_DECODED_BYTES`] or it is not wire format.
pub fn check<M: prost::Name>(encoded: &[u8]) -> Result<(), Refused> {
    match schema().root(M::PACKAGE, M::NAME) {
        Some(root) => check_root(root, encoded, M::full_name),
        None => Ok(()),
    }
}

/// [`check`] by the message's full protobuf name. A name the schema does not hold is not
/// checked (every message of this crate is in it; a test sees to that).
pub fn check_named(message: &str, encoded: &[u8]) -> Result<(), Refused> {
    match schema().index.get(message) {
        Some(&root) => check_root(root, encoded, || message.to_string()),
        None => Ok(()),
    }
}

/// Walks `encoded` as message `root` within [`MAX_DECODED_BYTES`]; `name` names it in a
/// refusal (built only then).
fn check_root(root: usize, encoded: &[u8], name: impl FnOnce() -> String) -> Result<(), Refused> {
    Walk::new(MAX_DECODED_BYTES)
        .message(root, encoded, 0, 0, false)
        .map_err(|why| Refused {
            message: name(),
            encoded: encoded.len(),
            why,
        })
}

/// An upper bound of what decoding `encoded`, a message named `message`, allocates; `None` for
/// a name the schema does not hold, or bytes [`check_named`] refuses as malformed. For tests
/// and measurements: receivers call [`check`].
pub fn decoded_bytes(message: &str, encoded: &[u8]) -> Option<usize> {
    let &root = schema().index.get(message)?;
    let mut walk = Walk::new(usize::MAX);
    walk.message(root, encoded, 0, 0, false).ok()?;
    Some(walk.cost + walk.largest)
}

/// The upper bound [`decoded_bytes`] counts for one decoded struct of the message named
/// `message` itself, without what it points to; `None` for an unknown name.
pub fn struct_bytes(message: &str) -> Option<usize> {
    let schema = schema();
    schema.index.get(message).map(|&i| schema.messages[i].size)
}

/// The schema, read once from [`crate::FILE_DESCRIPTOR_SET`].
struct Schema {
    messages: Vec<Shape>,
    /// Messages by full name.
    index: HashMap<String, usize>,
    /// Top-level messages by package, then name: looked up without building the full name.
    packages: HashMap<String, HashMap<String, usize>>,
}

impl Schema {
    fn root(&self, package: &str, name: &str) -> Option<usize> {
        self.packages.get(package)?.get(name).copied()
    }
}

struct Shape {
    /// Fields by number (numbers are small and dense).
    fields: Vec<Option<Field>>,
    /// An upper bound of the size of the struct this message decodes to.
    size: usize,
}

struct Field {
    name: String,
    repeated: bool,
    /// A `map<K, V>` field (a repeated entry message on the wire, a B-tree decoded).
    map: bool,
    kind: Kind,
}

#[derive(Clone, Copy)]
enum Kind {
    /// Index into `Schema::messages`.
    Message(usize),
    /// A string: its payload goes to the heap.
    Text,
    /// A bytes value: its payload goes to the heap, through a copy.
    Bytes,
    /// A number, bool or enum: eight bytes at most once decoded.
    Scalar,
}

fn schema() -> &'static Schema {
    static SCHEMA: OnceLock<Schema> = OnceLock::new();
    SCHEMA.get_or_init(|| {
        // Compiled in by the build script, from the same protoc run as the code: it cannot
        // fail to decode, and the tests decode it.
        #[allow(clippy::expect_used)]
        let set = FileDescriptorSet::decode(crate::FILE_DESCRIPTOR_SET)
            .expect("the compiled-in file descriptor set decodes");
        Schema::new(&set)
    })
}

impl Schema {
    fn new(set: &FileDescriptorSet) -> Self {
        let mut descriptors = Vec::new();
        let mut top = Vec::new();
        for file in &set.file {
            let package = file.package();
            for message in &file.message_type {
                collect(package, message, &mut descriptors);
                top.push((package.to_string(), message.name().to_string()));
            }
        }
        let index: HashMap<String, usize> = descriptors
            .iter()
            .enumerate()
            .map(|(i, (name, _))| (name.clone(), i))
            .collect();
        let mut packages: HashMap<String, HashMap<String, usize>> = HashMap::new();
        for (package, name) in top {
            if let Some(&i) = index.get(&format!("{package}.{name}")) {
                packages.entry(package).or_default().insert(name, i);
            }
        }
        let mut messages: Vec<Shape> = descriptors
            .iter()
            .map(|(_, d)| Shape {
                fields: numbered(d.field.iter().map(|f| {
                    let kind = match f.r#type() {
                        Type::Message | Type::Group => index
                            .get(f.type_name().trim_start_matches('.'))
                            .map_or(Kind::Text, |&i| Kind::Message(i)),
                        Type::String => Kind::Text,
                        Type::Bytes => Kind::Bytes,
                        _ => Kind::Scalar,
                    };
                    let map = match kind {
                        Kind::Message(i) => descriptors[i]
                            .1
                            .options
                            .as_ref()
                            .is_some_and(|o| o.map_entry()),
                        _ => false,
                    };
                    let field = Field {
                        name: f.name().to_string(),
                        repeated: f.label() == Label::Repeated,
                        map,
                        kind,
                    };
                    (usize::try_from(f.number()).unwrap_or(0), field)
                })),
                size: 0,
            })
            .collect();
        let mut sizes = vec![None; messages.len()];
        for i in 0..messages.len() {
            let size = struct_size(&descriptors, &index, i, &mut sizes, 0);
            messages[i].size = size;
        }
        Self {
            messages,
            index,
            packages,
        }
    }
}

/// Fields indexed by their number.
fn numbered(fields: impl Iterator<Item = (usize, Field)>) -> Vec<Option<Field>> {
    let mut out: Vec<Option<Field>> = Vec::new();
    for (number, field) in fields {
        if out.len() <= number {
            out.resize_with(number + 1, || None);
        }
        out[number] = Some(field);
    }
    out
}

/// Every message of `message`'s tree, with its full name.
fn collect(scope: &str, message: &DescriptorProto, out: &mut Vec<(String, DescriptorProto)>) {
    let name = if scope.is_empty() {
        message.name().to_string()
    } else {
        format!("{scope}.{}", message.name())
    };
    for nested in &message.nested_type {
        collect(&name, nested, out);
    }
    out.push((name, message.clone()));
}

/// An upper bound of the size of the struct message `i` decodes to: a vector, map, string or
/// bytes field takes 24 bytes, a number 8 (16 with its presence), a message held in place its
/// own size and 8 (the `Option`), the fields of a `oneof` their largest and 8; the sum rounded
/// up to 8.
fn struct_size(
    descriptors: &[(String, DescriptorProto)],
    index: &HashMap<String, usize>,
    i: usize,
    sizes: &mut [Option<usize>],
    depth: usize,
) -> usize {
    if let Some(size) = sizes[i] {
        return size;
    }
    let descriptor = &descriptors[i].1;
    let mut plain = 0;
    let mut oneofs: HashMap<i32, usize> = HashMap::new();
    for f in &descriptor.field {
        let size = if f.label() == Label::Repeated {
            24
        } else {
            match f.r#type() {
                Type::Message | Type::Group => {
                    match index.get(f.type_name().trim_start_matches('.')) {
                        Some(&j) if depth < MAX_DEPTH && j != i => {
                            struct_size(descriptors, index, j, sizes, depth + 1) + 8
                        }
                        // A message that holds itself is boxed: a pointer.
                        _ => 8,
                    }
                }
                Type::String | Type::Bytes => 24,
                _ if f.proto3_optional() => 16,
                _ => 8,
            }
        };
        match f.oneof_index {
            Some(o) if !f.proto3_optional() => {
                let widest = oneofs.entry(o).or_insert(0);
                *widest = (*widest).max(size);
            }
            _ => plain += size,
        }
    }
    let size = plain + oneofs.values().map(|w| w + 8).sum::<usize>();
    let size = size.div_ceil(8).max(1) * 8;
    sizes[i] = Some(size);
    size
}

struct Walk<'s> {
    schema: &'s Schema,
    /// What the entries and values walked so far take once decoded.
    cost: usize,
    /// The largest vector walked so far: when a vector grows, its old room and its new one
    /// are held at once, the old at most the size of what it finally holds.
    largest: usize,
    limit: usize,
    /// Field names from the root to where the walk is: the first `depth` of them.
    path: [&'s str; MAX_DEPTH + 2],
    depth: usize,
}

impl<'s> Walk<'s> {
    fn new(limit: usize) -> Self {
        Self {
            schema: schema(),
            cost: 0,
            largest: 0,
            limit,
            path: [""; MAX_DEPTH + 2],
            depth: 0,
        }
    }

    /// Adds `bytes`, spent on `field`, to the cost, refusing when it passes the limit.
    fn add(&mut self, field: &'s Field, bytes: usize) -> Result<(), Why> {
        self.cost = self.cost.saturating_add(bytes);
        if self.cost.saturating_add(self.largest) > self.limit {
            let mut path = self.path[..self.depth].to_vec();
            path.push(&field.name);
            return Err(Why::TooLarge {
                field: path.join("."),
            });
        }
        Ok(())
    }

    /// The size of one entry of the repeated `field` in its vector.
    fn element(&self, field: &Field) -> usize {
        match field.kind {
            Kind::Message(inner) => self.schema.messages[inner].size,
            Kind::Text | Kind::Bytes => 24,
            Kind::Scalar => 8,
        }
    }

    /// What one more entry of the repeated `field` costs: room for it in its vector (the
    /// first entry makes room for four, and a vector at most doubles what it holds), or for a
    /// map a share of a B-tree node (a node holds 11 entries, and at least 5 but for the
    /// first).
    /// In a struct decoded into before (`merged`), a vector may already hold entries: each new
    /// one counts its share of the vector's growth as well.
    fn entry(&self, field: &Field, first: bool, merged: bool) -> usize {
        if field.map {
            return if first {
                MAP_NODE_BYTES
            } else {
                MAP_NODE_BYTES / 5
            };
        }
        let element = self.element(field);
        if first {
            4 * element + ALLOCATION_BYTES
        } else if merged {
            3 * element
        } else {
            2 * element
        }
    }

    /// Walks the message `shape` encoded in `bytes`, which start at `offset` of the whole.
    /// `merged`: the struct it decodes into was decoded into before (its field was given
    /// again), so its strings and vectors are reused and grown rather than new.
    fn message(
        &mut self,
        shape: usize,
        bytes: &[u8],
        offset: usize,
        depth: usize,
        merged: bool,
    ) -> Result<(), Why> {
        if depth > MAX_DEPTH {
            return Err(Why::Malformed {
                at: offset,
                what: "messages nested deeper than any toolsrv message",
            });
        }
        let schema = self.schema;
        let malformed = |at: usize, what| Why::Malformed {
            at: offset + at,
            what,
        };
        // The entries of each repeated field of this struct so far, by field.
        // (A struct with more repeated fields than this counts each entry of the others as a
        // first one, which costs more than an entry and the vector's growth.)
        let mut vectors: [Option<(&'s Field, usize)>; 8] = [None; 8];
        // The singular fields (numbered below 64) given so far; one numbered above counts as
        // given again each time.
        let mut given = 0u64;
        let mut at = 0;
        while at < bytes.len() {
            let key = varint(bytes, &mut at).ok_or(malformed(at, "a field key that ends early"))?;
            let number = u32::try_from(key >> 3).unwrap_or(0);
            let field = usize::try_from(number)
                .ok()
                .and_then(|n| schema.messages[shape].fields.get(n))
                .and_then(Option::as_ref);
            let payload = match key & 7 {
                0 => {
                    varint(bytes, &mut at).ok_or(malformed(at, "a number that ends early"))?;
                    None
                }
                1 => {
                    at = skip(bytes, at, 8).ok_or(malformed(at, "a number that ends early"))?;
                    None
                }
                5 => {
                    at = skip(bytes, at, 4).ok_or(malformed(at, "a number that ends early"))?;
                    None
                }
                2 => {
                    let len = varint(bytes, &mut at)
                        .and_then(|len| usize::try_from(len).ok())
                        .ok_or(malformed(at, "a length that ends early"))?;
                    let start = at;
                    at = skip(bytes, at, len).ok_or(malformed(
                        at,
                        "a value that runs past the end of its message",
                    ))?;
                    Some((start, &bytes[start..at]))
                }
                _ => {
                    return Err(malformed(
                        at,
                        "a group or unknown wire type, which no toolsrv message uses",
                    ));
                }
            };
            // Fields this schema does not know are skipped by decoding, as here.
            let Some(field) = field else { continue };
            if field.repeated {
                let mut first = true;
                for slot in &mut vectors {
                    match slot {
                        Some((f, n)) if std::ptr::eq(*f, field) => {
                            *n += 1;
                            first = false;
                            break;
                        }
                        Some(_) => {}
                        None => {
                            *slot = Some((field, 1));
                            break;
                        }
                    }
                }
                self.add(field, self.entry(field, first, merged))?;
            }
            let Some((start, payload)) = payload else {
                continue;
            };
            // A singular field given before in this struct (or in the struct merged into) is
            // decoded into what the first made.
            let again = !field.repeated && {
                let bit = 1u64.checked_shl(number).unwrap_or(0);
                let before = merged || bit == 0 || given & bit != 0;
                given |= bit;
                before
            };
            match field.kind {
                Kind::Message(inner) => {
                    self.path[self.depth] = &field.name;
                    self.depth += 1;
                    self.message(inner, payload, offset + start, depth + 1, again)?;
                    self.depth -= 1;
                }
                Kind::Text | Kind::Bytes if payload.is_empty() => {}
                Kind::Text | Kind::Bytes => {
                    // A string is read into a buffer of its size. A field given again reuses
                    // the buffer, growing it (when it must) to twice its room or more: the
                    // old room and the new at once, less than four times what is read.
                    // Bytes are first copied out of the message: one more of their size.
                    let times = match (field.kind, again) {
                        (Kind::Text, false) => 1,
                        (Kind::Text, true) => 4,
                        (_, false) => 2,
                        (_, true) => 5,
                    };
                    self.add(field, times * (payload.len() + ALLOCATION_BYTES))?;
                }
                // Packed numbers: at least a byte each on the wire, 8 bytes each in a vector
                // that at most doubles them, and its old room while it grows.
                Kind::Scalar => self.add(field, 3 * 8 * payload.len() + ALLOCATION_BYTES)?,
            }
        }
        for (field, entries) in vectors.into_iter().flatten() {
            if !field.map {
                let held = entries.saturating_mul(self.element(field));
                if held > self.largest {
                    self.largest = held;
                    self.add(field, 0)?;
                }
            }
        }
        Ok(())
    }
}

/// Reads a varint at `*at` as decoding does, moving past it.
fn varint(bytes: &[u8], at: &mut usize) -> Option<u64> {
    let mut rest = bytes.get(*at..)?;
    let value = prost::encoding::decode_varint(&mut rest).ok()?;
    *at = bytes.len() - rest.len();
    Some(value)
}

/// The end of `len` bytes from `at`, if they are there.
fn skip(bytes: &[u8], at: usize, len: usize) -> Option<usize> {
    at.checked_add(len).filter(|&end| end <= bytes.len())
}

const _: () = assert!(MAX_DECODED_BYTES >= MAX_MESSAGE_BYTES);
