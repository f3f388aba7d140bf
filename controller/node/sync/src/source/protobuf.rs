//! EndpointSlices in the API server's protobuf encoding (`application/vnd.kubernetes.protobuf`),
//! decoded straight into [`LeanSlice`]s: only the fields the agent reads are kept, everything
//! else is skipped by its wire length without being parsed.
//!
//! The API server encodes a built-in object as the 4 bytes `k8s\0` followed by a
//! `runtime.Unknown` message whose `raw` field holds the object itself (`EndpointSliceList`,
//! `EndpointSlice`, or `Status` for an error). A watch response is a stream of frames, each a
//! 4-byte big-endian length and a `metav1.WatchEvent` (`type`, and `object.raw`: an object as
//! above). Field numbers are those of `k8s.io/api/discovery/v1/generated.proto` and
//! `k8s.io/apimachinery/pkg/apis/meta/v1/generated.proto`.
//!
//! Why: serving 200k EndpointSlices as JSON was most of a full sync at 1M endpoints; protobuf
//! is several times less for the API server to write and for the agent to read (docs/performance.md).
//!
//! Any input is decoded without panicking: lengths are checked against what is left, varints
//! are at most 10 bytes, a string that is not UTF-8 is an error, and the nesting is the
//! schema's (no recursion driven by the input).

use std::collections::BTreeMap;

use k8s_openapi::{
    api::discovery::v1::{EndpointConditions, EndpointPort},
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use kube::core::Status;

use crate::convert::{LeanEndpoint, LeanSlice};

/// The prefix of every protobuf-encoded object.
pub const MAGIC: &[u8; 4] = b"k8s\0";
/// The media type of lists and objects.
pub const MEDIA_TYPE: &str = "application/vnd.kubernetes.protobuf";
/// The media type of watch streams.
pub const WATCH_MEDIA_TYPE: &str = "application/vnd.kubernetes.protobuf;stream=watch";
/// The largest watch frame accepted (the API server's default request limit is 3 MiB an
/// object; a frame holds one object and its event).
pub const MAX_FRAME_BYTES: usize = 16 << 20;

/// Why bytes could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("protobuf: {0}")]
pub struct DecodeError(pub &'static str);

type Result<T> = std::result::Result<T, DecodeError>;

const NOT_PROTOBUF: DecodeError =
    DecodeError("not a Kubernetes protobuf object (no k8s\\0 prefix)");

/// A field's value on the wire.
enum Value<'a> {
    Varint(u64),
    Bytes(&'a [u8]),
    /// Fixed 32 or 64 bits: no field we read has them.
    Fixed,
}

/// Reads the fields of one message.
#[derive(Debug)]
struct Fields<'a> {
    buf: &'a [u8],
}

impl<'a> Fields<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Self { buf }
    }

    fn varint(&mut self) -> Result<u64> {
        let mut v: u64 = 0;
        for i in 0..10 {
            let (&b, rest) = self
                .buf
                .split_first()
                .ok_or(DecodeError("truncated varint"))?;
            self.buf = rest;
            if i == 9 && b > 1 {
                return Err(DecodeError("varint overflows 64 bits"));
            }
            v |= u64::from(b & 0x7f) << (7 * i);
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        // The tenth byte either ended the varint or was refused above.
        Err(DecodeError("varint overflows 64 bits"))
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if n > self.buf.len() {
            return Err(DecodeError("length past the end"));
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }

    /// The next field: its number and value; `None` at the end.
    fn next_field(&mut self) -> Result<Option<(u64, Value<'a>)>> {
        if self.buf.is_empty() {
            return Ok(None);
        }
        let key = self.varint()?;
        let field = key >> 3;
        if field == 0 {
            return Err(DecodeError("field number 0"));
        }
        let value = match key & 7 {
            0 => Value::Varint(self.varint()?),
            1 => {
                self.take(8)?;
                Value::Fixed
            }
            2 => {
                let n = usize::try_from(self.varint()?).map_err(|_| DecodeError("length"))?;
                Value::Bytes(self.take(n)?)
            }
            5 => {
                self.take(4)?;
                Value::Fixed
            }
            _ => return Err(DecodeError("unsupported wire type")),
        };
        Ok(Some((field, value)))
    }
}

fn bytes<'a>(v: Value<'a>) -> Result<&'a [u8]> {
    match v {
        Value::Bytes(b) => Ok(b),
        _ => Err(DecodeError("expected a length-delimited field")),
    }
}

fn string(v: Value<'_>) -> Result<String> {
    std::str::from_utf8(bytes(v)?)
        .map(str::to_owned)
        .map_err(|_| DecodeError("string is not UTF-8"))
}

fn varint(v: Value<'_>) -> Result<u64> {
    match v {
        Value::Varint(n) => Ok(n),
        _ => Err(DecodeError("expected a varint field")),
    }
}

/// A `runtime.Unknown` envelope: the object's kind and its encoded bytes.
#[derive(Debug, PartialEq, Eq)]
pub struct Envelope<'a> {
    /// `typeMeta.kind` (e.g. `EndpointSliceList`, `Status`).
    pub kind: String,
    /// The object.
    pub raw: &'a [u8],
}

/// Opens the `k8s\0` + `runtime.Unknown` envelope of an object.
pub fn envelope(buf: &[u8]) -> Result<Envelope<'_>> {
    let body = buf.strip_prefix(MAGIC.as_slice()).ok_or(NOT_PROTOBUF)?;
    let mut out = Envelope {
        kind: String::new(),
        raw: &[],
    };
    let mut f = Fields::new(body);
    while let Some((n, v)) = f.next_field()? {
        match n {
            1 => {
                let mut t = Fields::new(bytes(v)?);
                while let Some((n, v)) = t.next_field()? {
                    if n == 2 {
                        out.kind = string(v)?;
                    }
                }
            }
            2 => out.raw = bytes(v)?,
            3 if !bytes(v)?.is_empty() => {
                return Err(DecodeError(
                    "encoded content (contentEncoding) is not supported",
                ));
            }
            _ => {}
        }
    }
    Ok(out)
}

/// The list metadata the watcher needs.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct ListMeta {
    /// `resourceVersion`: where the watch starts.
    pub resource_version: String,
    /// `continue`: the next page's token, empty on the last page.
    pub continue_token: String,
}

fn list_meta(buf: &[u8]) -> Result<ListMeta> {
    let mut m = ListMeta::default();
    let mut f = Fields::new(buf);
    while let Some((n, v)) = f.next_field()? {
        match n {
            2 => m.resource_version = string(v)?,
            3 => m.continue_token = string(v)?,
            _ => {}
        }
    }
    Ok(m)
}

/// `ObjectMeta`: name, namespace, resourceVersion and labels (all the agent reads of a slice).
fn object_meta(buf: &[u8]) -> Result<ObjectMeta> {
    let mut m = ObjectMeta::default();
    let mut labels = BTreeMap::new();
    let mut f = Fields::new(buf);
    while let Some((n, v)) = f.next_field()? {
        match n {
            1 => m.name = Some(string(v)?),
            3 => m.namespace = Some(string(v)?),
            6 => m.resource_version = Some(string(v)?),
            11 => {
                let (mut key, mut value) = (String::new(), String::new());
                let mut e = Fields::new(bytes(v)?);
                while let Some((n, v)) = e.next_field()? {
                    match n {
                        1 => key = string(v)?,
                        2 => value = string(v)?,
                        _ => {}
                    }
                }
                labels.insert(key, value);
            }
            _ => {}
        }
    }
    if !labels.is_empty() {
        m.labels = Some(labels);
    }
    Ok(m)
}

fn bool_field(v: Value<'_>) -> Result<bool> {
    Ok(varint(v)? != 0)
}

fn conditions(buf: &[u8]) -> Result<EndpointConditions> {
    let mut c = EndpointConditions::default();
    let mut f = Fields::new(buf);
    while let Some((n, v)) = f.next_field()? {
        match n {
            1 => c.ready = Some(bool_field(v)?),
            2 => c.serving = Some(bool_field(v)?),
            3 => c.terminating = Some(bool_field(v)?),
            _ => {}
        }
    }
    Ok(c)
}

/// An `Endpoint` without `targetRef`, hints or deprecated topology.
fn endpoint(buf: &[u8]) -> Result<LeanEndpoint> {
    let mut e = LeanEndpoint::default();
    let mut f = Fields::new(buf);
    while let Some((n, v)) = f.next_field()? {
        match n {
            1 => e.addresses.push(string(v)?),
            2 => e.conditions = Some(conditions(bytes(v)?)?),
            3 => e.hostname = Some(string(v)?),
            6 => e.node_name = Some(string(v)?),
            7 => e.zone = Some(string(v)?),
            _ => {}
        }
    }
    Ok(e)
}

fn port(buf: &[u8]) -> Result<EndpointPort> {
    let mut p = EndpointPort::default();
    let mut f = Fields::new(buf);
    while let Some((n, v)) = f.next_field()? {
        match n {
            1 => p.name = Some(string(v)?),
            2 => p.protocol = Some(string(v)?),
            // int32 on the wire: a negative value is sign-extended to 64 bits.
            3 => p.port = Some(varint(v)? as i64 as i32),
            4 => p.app_protocol = Some(string(v)?),
            _ => {}
        }
    }
    Ok(p)
}

/// An `EndpointSlice` message (the bytes inside the envelope).
pub fn slice(buf: &[u8]) -> Result<LeanSlice> {
    let mut s = LeanSlice {
        metadata: ObjectMeta::default(),
        address_type: String::new(),
        endpoints: None,
        ports: None,
    };
    let mut f = Fields::new(buf);
    while let Some((n, v)) = f.next_field()? {
        match n {
            1 => s.metadata = object_meta(bytes(v)?)?,
            2 => s
                .endpoints
                .get_or_insert_with(Vec::new)
                .push(endpoint(bytes(v)?)?),
            3 => s.ports.get_or_insert_with(Vec::new).push(port(bytes(v)?)?),
            4 => s.address_type = string(v)?,
            _ => {}
        }
    }
    Ok(s)
}

/// What a [`ListStream`] gives, in the order of the response (the API server writes the
/// list's metadata before its items).
#[derive(Debug)]
#[allow(
    clippy::large_enum_variant,
    reason = "nearly every part is an item, moved on at once; boxing it would allocate once more per item"
)]
pub enum ListPart {
    /// The list's metadata: where the watch starts, the next page's token.
    Meta(ListMeta),
    /// One item.
    Item(LeanSlice),
}

/// Where a [`ListStream`] is in the response.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum ListAt {
    /// Before the `k8s\0` prefix.
    #[default]
    Magic,
    /// In the envelope, before its `raw` field (the list).
    Envelope,
    /// In the list; this many of its bytes are still to be read.
    List(usize),
    /// In the envelope, after the list.
    After,
}

/// Decodes an `EndpointSliceList` response as its bytes arrive: fed the body in pieces of
/// any size, it gives the list's metadata and each item as soon as their bytes are all
/// there, and keeps only the bytes not yet decoded (at most one item's worth and a read's).
/// So a list of 1M endpoints (138 MB) is never held whole, and decoding overlaps the
/// transfer. An item (a field) over [`MAX_FRAME_BYTES`] is an error, not a buffer that
/// grows.
#[derive(Debug, Default)]
pub struct ListStream {
    buf: Vec<u8>,
    /// How much of `buf` is decoded.
    used: usize,
    at: ListAt,
}

impl ListStream {
    /// Adds the next bytes of the response.
    pub fn feed(&mut self, data: &[u8]) {
        if self.used == self.buf.len() {
            self.buf.clear();
            self.used = 0;
        } else if self.used >= 64 << 10 {
            self.buf.drain(..self.used);
            self.used = 0;
        }
        self.buf.extend_from_slice(data);
    }

    /// The next part, `None` until more bytes are fed (or after the last).
    pub fn next_part(&mut self) -> Result<Option<ListPart>> {
        loop {
            let rest = &self.buf[self.used..];
            match self.at {
                ListAt::Magic => {
                    let n = rest.len().min(MAGIC.len());
                    if rest[..n] != MAGIC[..n] {
                        return Err(NOT_PROTOBUF);
                    }
                    if n < MAGIC.len() {
                        return Ok(None);
                    }
                    self.used += MAGIC.len();
                    self.at = ListAt::Envelope;
                }
                ListAt::Envelope | ListAt::After => {
                    let Some(f) = extent(rest)? else {
                        return Ok(None);
                    };
                    if self.at == ListAt::Envelope && f.number == 2 && f.wire == 2 {
                        // The list (`raw`), of any size: read field by field as it arrives.
                        self.used += f.value;
                        self.at = ListAt::List(f.len);
                        continue;
                    }
                    // typeMeta, contentType, anything else: whole, and not needed (as in
                    // [`envelope`]).
                    let end = f.buffered_end()?;
                    if rest.len() < end {
                        return Ok(None);
                    }
                    if f.number == 3 && f.len > 0 {
                        return Err(DecodeError(
                            "encoded content (contentEncoding) is not supported",
                        ));
                    }
                    self.used += end;
                }
                ListAt::List(0) => self.at = ListAt::After,
                ListAt::List(left) => {
                    let within = &rest[..rest.len().min(left)];
                    let Some(f) = extent(within)? else {
                        if within.len() == left {
                            return Err(DecodeError("truncated varint"));
                        }
                        return Ok(None);
                    };
                    let end = f.buffered_end()?;
                    if end > left {
                        return Err(DecodeError("length past the end"));
                    }
                    let Some(field) = within.get(f.value..end) else {
                        return Ok(None);
                    };
                    let part = match (f.number, f.wire) {
                        (1, 2) => Some(ListPart::Meta(list_meta(field)?)),
                        (2, 2) => Some(ListPart::Item(slice(field)?)),
                        (1 | 2, _) => return Err(DecodeError("expected a length-delimited field")),
                        _ => None,
                    };
                    self.used += end;
                    self.at = ListAt::List(left - end);
                    if part.is_some() {
                        return Ok(part);
                    }
                }
            }
        }
    }

    /// At the end of the body: `Ok` only when the whole list and its envelope were read.
    pub fn finish(&self) -> Result<()> {
        if self.at != ListAt::After || self.used != self.buf.len() {
            return Err(DecodeError("list response ends early"));
        }
        Ok(())
    }
}

/// Where a field lies at the front of a buffer, from its key (and length) alone: its value
/// starts at `value` and is `len` bytes long, which may reach past what has arrived.
struct Extent {
    number: u64,
    wire: u64,
    value: usize,
    len: usize,
}

impl Extent {
    /// Where the field ends, for a field that is decoded whole (so held whole): one over
    /// [`MAX_FRAME_BYTES`] is refused rather than waited for.
    fn buffered_end(&self) -> Result<usize> {
        if self.len > MAX_FRAME_BYTES {
            return Err(DecodeError("field over 16 MiB"));
        }
        Ok(self.value + self.len)
    }
}

/// The [`Extent`] of the field at the front of `buf`; `None` while its key or length is
/// incomplete.
fn extent(buf: &[u8]) -> Result<Option<Extent>> {
    let Some((key, k)) = partial_varint(buf)? else {
        return Ok(None);
    };
    let (number, wire) = (key >> 3, key & 7);
    if number == 0 {
        return Err(DecodeError("field number 0"));
    }
    let (value, len) = match wire {
        0 => match partial_varint(&buf[k..])? {
            Some((_, n)) => (k, n),
            None => return Ok(None),
        },
        1 => (k, 8),
        2 => match partial_varint(&buf[k..])? {
            Some((n, l)) => (
                k + l,
                usize::try_from(n).map_err(|_| DecodeError("length"))?,
            ),
            None => return Ok(None),
        },
        5 => (k, 4),
        _ => return Err(DecodeError("unsupported wire type")),
    };
    Ok(Some(Extent {
        number,
        wire,
        value,
        len,
    }))
}

/// A varint at the front of `buf` and its length; `None` while it is incomplete.
fn partial_varint(buf: &[u8]) -> Result<Option<(u64, usize)>> {
    let mut f = Fields::new(buf);
    match f.varint() {
        Ok(v) => Ok(Some((v, buf.len() - f.buf.len()))),
        Err(_) if buf.len() < 10 && buf.iter().all(|b| b & 0x80 != 0) => Ok(None),
        Err(e) => Err(e),
    }
}

/// A `metav1.Status` message (an error the API server sends instead of an object): its
/// code (410: the resource version is too old), reason and message.
pub fn status(buf: &[u8]) -> Result<Status> {
    let mut s = Status::default();
    let mut f = Fields::new(buf);
    while let Some((n, v)) = f.next_field()? {
        match n {
            3 => s.message = string(v)?,
            4 => s.reason = string(v)?,
            6 => s.code = u16::try_from(varint(v)? as i64 as i32).unwrap_or(0),
            _ => {}
        }
    }
    Ok(s)
}

/// A watch event: its type (`ADDED`, `MODIFIED`, `DELETED`, `BOOKMARK`, `ERROR`) and its
/// object, still in its envelope.
pub fn watch_event(frame: &[u8]) -> Result<(String, &[u8])> {
    let (mut kind, mut object) = (String::new(), &[][..]);
    let mut f = Fields::new(frame);
    while let Some((n, v)) = f.next_field()? {
        match n {
            1 => kind = string(v)?,
            2 => {
                let mut r = Fields::new(bytes(v)?);
                while let Some((n, v)) = r.next_field()? {
                    if n == 1 {
                        object = bytes(v)?;
                    }
                }
            }
            _ => {}
        }
    }
    Ok((kind, object))
}

/// Splits watch frames (4-byte big-endian length, then the event) off the front of `buf`:
/// the next complete frame and how many bytes it took, `None` while it is incomplete.
pub fn next_frame(buf: &[u8]) -> Result<Option<(&[u8], usize)>> {
    let Some(len) = buf.get(..4) else {
        return Ok(None);
    };
    let n = u32::from_be_bytes([len[0], len[1], len[2], len[3]]) as usize;
    if n > MAX_FRAME_BYTES {
        return Err(DecodeError("watch frame over 16 MiB"));
    }
    Ok(buf.get(4..4 + n).map(|frame| (frame, 4 + n)))
}

#[cfg(test)]
pub(crate) mod encode {
    //! A minimal protobuf writer for the tests (the API server is the real encoder; see the
    //! kube source's integration tests).

    pub fn varint(out: &mut Vec<u8>, mut v: u64) {
        while v >= 0x80 {
            out.push((v as u8) | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }

    pub fn bytes(out: &mut Vec<u8>, field: u64, b: &[u8]) {
        varint(out, field << 3 | 2);
        varint(out, b.len() as u64);
        out.extend_from_slice(b);
    }

    pub fn num(out: &mut Vec<u8>, field: u64, v: u64) {
        varint(out, field << 3);
        varint(out, v);
    }

    pub fn msg(field: u64, parts: &[Vec<u8>]) -> Vec<u8> {
        let mut body = Vec::new();
        for p in parts {
            body.extend_from_slice(p);
        }
        let mut out = Vec::new();
        bytes(&mut out, field, &body);
        out
    }

    pub fn s(field: u64, v: &str) -> Vec<u8> {
        let mut out = Vec::new();
        bytes(&mut out, field, v.as_bytes());
        out
    }

    pub fn n(field: u64, v: u64) -> Vec<u8> {
        let mut out = Vec::new();
        num(&mut out, field, v);
        out
    }

    pub fn cat(parts: &[Vec<u8>]) -> Vec<u8> {
        parts.concat()
    }

    /// `k8s\0` + Unknown{typeMeta{kind}, raw}.
    pub fn envelope(kind: &str, raw: &[u8]) -> Vec<u8> {
        let mut out = super::MAGIC.to_vec();
        out.extend(msg(1, &[s(1, "v1"), s(2, kind)]));
        let mut r = Vec::new();
        bytes(&mut r, 2, raw);
        out.extend(r);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::{
        encode::{bytes, cat, envelope, msg, n, s},
        *,
    };

    fn a_slice() -> Vec<u8> {
        cat(&[
            msg(
                1,
                &[
                    s(1, "web-c1"),
                    s(3, "shop"),
                    s(6, "42"),
                    // managedFields (17) and an annotation (12): skipped.
                    msg(17, &[s(1, "kube-controller-manager")]),
                    msg(12, &[s(1, "a"), s(2, "b")]),
                    msg(
                        11,
                        &[s(1, "multicluster.kubernetes.io/service-name"), s(2, "web")],
                    ),
                    msg(
                        11,
                        &[
                            s(1, "multicluster.kubernetes.io/source-cluster"),
                            s(2, "c1"),
                        ],
                    ),
                ],
            ),
            s(4, "IPv4"),
            msg(
                2,
                &[
                    s(1, "198.18.1.2"),
                    msg(2, &[n(1, 1), n(2, 1), n(3, 0)]),
                    // targetRef (4) and hints (8): skipped.
                    msg(4, &[s(2, "pod-a")]),
                    msg(8, &[msg(1, &[s(1, "z1")])]),
                    s(6, "node-1"),
                    s(7, "z1"),
                ],
            ),
            msg(2, &[s(1, "198.18.1.3"), s(3, "web-1")]),
            msg(3, &[s(1, "http"), s(2, "TCP"), n(3, 8080)]),
        ])
    }

    #[test]
    fn a_slice_decodes_to_the_fields_the_agent_reads() {
        let sl = slice(&a_slice()).unwrap();
        assert_eq!(sl.metadata.name.as_deref(), Some("web-c1"));
        assert_eq!(sl.metadata.namespace.as_deref(), Some("shop"));
        assert_eq!(sl.metadata.resource_version.as_deref(), Some("42"));
        let labels = sl.metadata.labels.as_ref().unwrap();
        assert_eq!(labels.len(), 2);
        assert_eq!(labels["multicluster.kubernetes.io/source-cluster"], "c1");
        assert_eq!(sl.address_type, "IPv4");
        let eps = sl.endpoints.as_ref().unwrap();
        assert_eq!(eps.len(), 2);
        assert_eq!(eps[0].addresses, ["198.18.1.2"]);
        let c = eps[0].conditions.as_ref().unwrap();
        assert_eq!(
            (c.ready, c.serving, c.terminating),
            (Some(true), Some(true), Some(false))
        );
        assert_eq!(eps[0].node_name.as_deref(), Some("node-1"));
        assert_eq!(eps[0].zone.as_deref(), Some("z1"));
        assert!(eps[1].conditions.is_none());
        assert_eq!(eps[1].hostname.as_deref(), Some("web-1"));
        let ports = sl.ports.as_ref().unwrap();
        assert_eq!(ports[0].name.as_deref(), Some("http"));
        assert_eq!(ports[0].port, Some(8080));
    }

    #[test]
    fn a_list_in_its_envelope_gives_items_and_where_to_go_on() {
        // ListMeta (1), then the slice as item (2).
        let list = cat(&[
            msg(1, &[s(2, "1234"), s(3, "next-page")]),
            msg(2, &[a_slice()]),
        ]);
        let env = envelope("EndpointSliceList", &list);
        let e = super::envelope(&env).unwrap();
        assert_eq!(e.kind, "EndpointSliceList");
        let (items, meta) = slice_list(&env).unwrap();
        assert_eq!(items.len(), 1);
        assert_eq!(items[0].metadata.name.as_deref(), Some("web-c1"));
        assert_eq!(meta.resource_version, "1234");
        assert_eq!(meta.continue_token, "next-page");
    }

    /// The parts of `response`, fed to a [`ListStream`] in pieces of `step` bytes; the first
    /// error, also a response that ends early.
    fn parts(response: &[u8], step: usize) -> Result<Vec<ListPart>> {
        let mut list = ListStream::default();
        let mut got = Vec::new();
        for piece in response.chunks(step.max(1)) {
            list.feed(piece);
            while let Some(part) = list.next_part()? {
                got.push(part);
            }
        }
        list.finish()?;
        Ok(got)
    }

    /// A whole `EndpointSliceList` response (envelope included): its items and list metadata.
    fn slice_list(response: &[u8]) -> Result<(Vec<LeanSlice>, ListMeta)> {
        let (mut items, mut meta) = (Vec::new(), ListMeta::default());
        for part in parts(response, response.len())? {
            match part {
                ListPart::Meta(m) => meta = m,
                ListPart::Item(s) => items.push(s),
            }
        }
        Ok((items, meta))
    }

    /// A list response as the API server writes it: metadata, `n` items, and the envelope's
    /// (empty) contentEncoding and contentType after the list.
    fn a_list_response(n: usize) -> Vec<u8> {
        let mut list = msg(1, &[s(2, "77"), s(3, "")]);
        for _ in 0..n {
            list.extend(msg(2, &[a_slice()]));
        }
        let mut out = envelope("EndpointSliceList", &list);
        out.extend(s(3, ""));
        out.extend(s(4, ""));
        out
    }

    /// Feeds `response` in pieces of `step` bytes; the parts' names (`meta:VERSION` or the
    /// item's name), or the first error.
    fn streamed(response: &[u8], step: usize) -> Result<Vec<String>> {
        Ok(parts(response, step)?
            .into_iter()
            .map(|part| match part {
                ListPart::Meta(m) => format!("meta:{}", m.resource_version),
                ListPart::Item(s) => s.metadata.name.unwrap_or_default(),
            })
            .collect())
    }

    #[test]
    fn a_list_streamed_in_pieces_of_any_size_gives_what_the_whole_gives() {
        let response = a_list_response(3);
        let whole = streamed(&response, response.len()).unwrap();
        assert_eq!(whole, ["meta:77", "web-c1", "web-c1", "web-c1"]);
        for step in 1..response.len() {
            assert_eq!(
                streamed(&response, step).unwrap(),
                whole,
                "pieces of {step}"
            );
        }
        let empty = a_list_response(0);
        assert_eq!(streamed(&empty, 1).unwrap(), ["meta:77"]);
    }

    #[test]
    fn a_streamed_list_holds_only_what_it_has_not_decoded() {
        let response = a_list_response(2000);
        let item = msg(2, &[a_slice()]).len();
        let mut list = ListStream::default();
        let (mut items, mut held) = (0, 0);
        for piece in response.chunks(16 << 10) {
            list.feed(piece);
            held = held.max(list.buf.len());
            while let Some(part) = list.next_part().unwrap() {
                items += usize::from(matches!(part, ListPart::Item(_)));
            }
        }
        list.finish().unwrap();
        assert_eq!(items, 2000);
        assert!(response.len() > 4 * (80 << 10));
        assert!(
            held <= (64 << 10) + (16 << 10) + item,
            "held {held} bytes of {}",
            response.len()
        );
    }

    #[test]
    fn a_cut_or_encoded_list_is_an_error() {
        let response = a_list_response(2);
        // Cut anywhere in the list: an error by the end of the body, never a silent short
        // list. (A cut after it, in the envelope's last two fields, loses nothing.)
        let list_end = response.len() - 2 * s(3, "").len();
        for cut in 0..list_end {
            assert!(streamed(&response[..cut], 7).is_err(), "cut at {cut}");
        }
        let mut encoded = envelope("EndpointSliceList", &msg(1, &[s(2, "1")]));
        encoded.extend(s(3, "gzip"));
        assert_eq!(
            streamed(&encoded, 5).unwrap_err(),
            DecodeError("encoded content (contentEncoding) is not supported")
        );
        assert_eq!(streamed(b"{\"kind\"", 1).unwrap_err(), NOT_PROTOBUF);
        // An item that says it is 1 GiB is refused from its header, not waited for.
        let mut huge = MAGIC.to_vec();
        huge.extend([0x12, 0xff, 0xff, 0xff, 0xff, 0x0f]); // raw: 4 GiB
        huge.extend([0x12, 0x80, 0x80, 0x80, 0x80, 0x04]); // an item of 1 GiB
        let mut list = ListStream::default();
        list.feed(&huge);
        assert_eq!(
            list.next_part().unwrap_err(),
            DecodeError("field over 16 MiB")
        );
    }

    #[test]
    fn watch_frames_split_and_decode_including_an_error_status() {
        let status_env = envelope(
            "Status",
            &cat(&[s(3, "too old resource version"), s(4, "Expired"), n(6, 410)]),
        );
        let ev = cat(&[
            s(1, "ERROR"),
            msg(
                2,
                &[{
                    let mut r = Vec::new();
                    bytes(&mut r, 1, &status_env);
                    r
                }],
            ),
        ]);
        let mut stream = (ev.len() as u32).to_be_bytes().to_vec();
        stream.extend(&ev);
        stream.extend([0, 0]); // the start of the next frame
        let (frame, used) = next_frame(&stream).unwrap().unwrap();
        assert_eq!(used, 4 + ev.len());
        assert_eq!(next_frame(&stream[used..]).unwrap(), None);
        let (kind, object) = watch_event(frame).unwrap();
        assert_eq!(kind, "ERROR");
        let e = super::envelope(object).unwrap();
        assert_eq!(e.kind, "Status");
        let st = status(e.raw).unwrap();
        assert_eq!(st.code, 410);
        assert_eq!(st.reason, "Expired");
        assert_eq!(
            next_frame(&u32::MAX.to_be_bytes()),
            Err(DecodeError("watch frame over 16 MiB"))
        );
    }

    #[test]
    fn broken_input_is_an_error_not_a_panic() {
        assert!(super::envelope(b"{\"kind\":\"List\"}").is_err());
        let good = a_slice();
        // Every truncation and every single-byte change decodes or fails, never panics.
        for cut in 0..good.len() {
            let _ = slice(&good[..cut]);
        }
        for i in 0..good.len() {
            for b in [0x00, 0x7f, 0x80, 0xff] {
                let mut bad = good.clone();
                bad[i] = b;
                let _ = slice(&bad);
                let _ = slice_list(&bad);
                let _ = watch_event(&bad);
            }
        }
        assert_eq!(
            slice(&[0xff; 11]).unwrap_err(),
            DecodeError("varint overflows 64 bits")
        );
        assert!(
            slice(&cat(&[s(4, "IPv4")])[..3]).is_err(),
            "length past the end"
        );
        assert_eq!(
            slice(&[0x22, 0x02, 0xc3, 0x28]).unwrap_err(),
            DecodeError("string is not UTF-8")
        );
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(b in proptest::collection::vec(proptest::num::u8::ANY, 0..512)) {
            let _ = slice(&b);
            let _ = slice_list(&b);
            let _ = watch_event(&b);
            let _ = super::envelope(&b);
            let _ = status(&b);
            let _ = next_frame(&b);
        }

        #[test]
        fn arbitrary_bytes_streamed_in_arbitrary_pieces_never_panic(
            b in proptest::collection::vec(proptest::num::u8::ANY, 0..512),
            step in 1usize..64,
        ) {
            let mut prefixed = MAGIC.to_vec();
            prefixed.extend(&b);
            let _ = streamed(&b, step);
            let _ = streamed(&prefixed, step);
        }
    }
}
