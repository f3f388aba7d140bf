//! List + watch of EndpointSlices in protobuf ([`super::protobuf`]), as a stream of the same
//! `kube::runtime::watcher` events and errors the JSON watcher gives, so the kube source treats
//! both alike (its `Relister`, retries and `410 Gone` handling).
//!
//! What it does, as kube-rs's watcher does with `ListWatch`: a consistent list in pages
//! (`limit`, `continue`), then a watch from the list's `resourceVersion` with bookmarks and a
//! server-side timeout of 290 s, watched again from the last version it saw when the server
//! ends it, and listed again on `410 Gone` (the list's continue token or the watch's version
//! expired). A failed request is an error item; the next poll tries again from where it was,
//! so the caller's backoff paces the retries.

use std::time::Duration;

use futures::Stream;
use http_body_util::BodyExt as _;
use kube::{
    Client,
    api::{ListParams, WatchParams},
    client::Body,
    core::{Request, Status},
    runtime::watcher::{Error, Event},
};

use super::protobuf::{self, DecodeError, ListPart};
use crate::convert::LeanSlice;

/// The server-side timeout of a watch request (kube-rs's default).
const WATCH_TIMEOUT_S: u32 = 290;
/// How long a watch may stay silent past its timeout before it is taken for dead.
const WATCH_IDLE_MARGIN: Duration = Duration::from_secs(5);
const PATH: &str = "/apis/discovery.k8s.io/v1/endpointslices";

/// Whether the API server answers EndpointSlice lists in protobuf: one request for one slice.
/// `Err` when the request itself failed (the caller retries).
pub async fn serves_protobuf(client: &Client, label_selector: &str) -> Result<bool, kube::Error> {
    let res = send(
        client,
        list_request(label_selector, ListFrom::Etcd { page_size: 1 }, ""),
        &format!("{}, application/json", protobuf::MEDIA_TYPE),
    )
    .await?;
    let protobuf = content_type(&res).starts_with(protobuf::MEDIA_TYPE);
    let status = res.status();
    let body = res.into_body().collect_bytes().await?;
    if !status.is_success() {
        return Err(kube::Error::Api(error_status(status, &body).boxed()));
    }
    Ok(protobuf)
}

/// Where the list that starts a watch is read from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ListFrom {
    /// A consistent read (etcd, or the watch cache where the API server serves consistent
    /// reads from it), in pages of `page_size`.
    Etcd {
        /// Objects per page.
        page_size: u32,
    },
    /// The API server's watch cache (`resourceVersion=0`), in one response: it may lag etcd
    /// a little; the watch from its version brings it up to date.
    Cache,
}

/// The stream of watcher events of the EndpointSlices that match `label_selector`.
pub fn slices(
    client: Client,
    label_selector: String,
    list: ListFrom,
) -> impl Stream<Item = Result<Event<LeanSlice>, Error>> + Send + 'static {
    async_stream::stream! {
        // Where the watch goes on from; `None`: list first.
        let mut version: Option<String> = None;
        loop {
            let Some(from) = version.clone() else {
                yield Ok(Event::Init);
                // The next page is fetched while this one's items are handed on, so the API
                // server's work and ours overlap; a page read live is decoded as it arrives.
                let mut pending: Option<Prefetch> = None;
                let mut next = String::new();
                loop {
                    let opened = match pending.take() {
                        Some(p) => p.get().await.map(ListBody::fetched),
                        None => open_list(&client, &label_selector, list, &next)
                            .await
                            .map(ListBody::live),
                    };
                    let mut page = match opened {
                        Ok(p) => p,
                        Err(e) => {
                            // Listed again from the start on the next poll (a 410 means the
                            // continue token expired: the same).
                            yield Err(Error::InitialListFailed(e));
                            break;
                        }
                    };
                    let mut meta = protobuf::ListMeta::default();
                    let failed = loop {
                        match page.next_part().await {
                            Ok(Some(ListPart::Meta(m))) => {
                                // Written before the items: the next page starts now.
                                pending = (!m.continue_token.is_empty()).then(|| {
                                    Prefetch::start(&client, &label_selector, list, &m.continue_token)
                                });
                                meta = m;
                            }
                            Ok(Some(ListPart::Item(s))) => yield Ok(Event::InitApply(s)),
                            Ok(None) => break None,
                            Err(e) => break Some(e),
                        }
                    };
                    if let Some(e) = failed {
                        yield Err(Error::InitialListFailed(e));
                        break;
                    }
                    if meta.continue_token.is_empty() {
                        version = Some(meta.resource_version);
                        yield Ok(Event::InitDone);
                        break;
                    }
                    next = meta.continue_token;
                }
                continue;
            };
            let watched_at = tokio::time::Instant::now();
            let mut got_data = false;
            let res = match send(&client, watch_request(&label_selector, &from), protobuf::WATCH_MEDIA_TYPE).await {
                Ok(r) => r,
                Err(e) => {
                    yield Err(Error::WatchStartFailed(e));
                    continue;
                }
            };
            if !res.status().is_success() {
                let code = res.status();
                let body = res.into_body().collect_bytes().await.unwrap_or_default();
                let status = error_status(code, &body);
                if status.code == 410 {
                    version = None;
                    yield Err(Error::WatchError(status.boxed()));
                } else {
                    yield Err(Error::WatchStartFailed(kube::Error::Api(status.boxed())));
                }
                continue;
            }
            let mut body = res.into_body();
            let mut buf: Vec<u8> = Vec::new();
            let idle = Duration::from_secs(u64::from(WATCH_TIMEOUT_S)) + WATCH_IDLE_MARGIN;
            'frames: loop {
                // Every complete frame in the buffer first.
                let mut used = 0;
                loop {
                    let frame = match protobuf::next_frame(&buf[used..]) {
                        Ok(Some((frame, n))) => {
                            used += n;
                            frame
                        }
                        Ok(None) => break,
                        Err(e) => {
                            yield Err(Error::WatchFailed(decode_error(e)));
                            break 'frames;
                        }
                    };
                    match event(frame) {
                        Ok(Watched::Object(kind, s)) => {
                            if let Some(v) = &s.metadata.resource_version {
                                version = Some(v.clone());
                            }
                            yield Ok(if kind == Kind::Deleted { Event::Delete(s) } else { Event::Apply(s) });
                        }
                        Ok(Watched::Bookmark(v)) => version = Some(v),
                        Ok(Watched::Failure(status)) => {
                            if status.code == 410 {
                                version = None;
                            }
                            yield Err(Error::WatchError(status.boxed()));
                            break 'frames;
                        }
                        Err(e) => {
                            // Watched again from the last version seen: the event is not lost.
                            yield Err(Error::WatchFailed(decode_error(e)));
                            break 'frames;
                        }
                    }
                }
                buf.drain(..used);
                match tokio::time::timeout(idle, body.frame()).await {
                    Ok(Some(Ok(frame))) => {
                        if let Ok(data) = frame.into_data() {
                            got_data |= !data.is_empty();
                            buf.extend_from_slice(&data);
                        }
                    }
                    // The server ended the watch (its timeout): watch again. One that ends
                    // it at once with nothing sent is a failure, so the watch is asked
                    // again after a backoff step, not in a tight loop.
                    Ok(None) => {
                        if !got_data && watched_at.elapsed() < ENDED_AT_ONCE {
                            yield Err(Error::WatchFailed(kube::Error::Service(
                                "the API server ended the EndpointSlice watch at once with nothing sent".into(),
                            )));
                        }
                        break;
                    }
                    Ok(Some(Err(e))) => {
                        yield Err(Error::WatchFailed(e));
                        break;
                    }
                    Err(_) => {
                        tracing::debug!("EndpointSlice watch silent past its timeout; watching again");
                        break;
                    }
                }
            }
        }
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Kind {
    Applied,
    Deleted,
}

/// A watch event, decoded.
enum Watched {
    Object(Kind, LeanSlice),
    Bookmark(String),
    Failure(Status),
}

fn event(frame: &[u8]) -> Result<Watched, DecodeError> {
    let (kind, object) = protobuf::watch_event(frame)?;
    let object = protobuf::envelope(object)?;
    match kind.as_str() {
        "ADDED" | "MODIFIED" => Ok(Watched::Object(Kind::Applied, protobuf::slice(object.raw)?)),
        "DELETED" => Ok(Watched::Object(Kind::Deleted, protobuf::slice(object.raw)?)),
        "BOOKMARK" => Ok(Watched::Bookmark(
            protobuf::slice(object.raw)?
                .metadata
                .resource_version
                .unwrap_or_default(),
        )),
        "ERROR" => Ok(Watched::Failure(protobuf::status(object.raw)?)),
        _ => Err(DecodeError("unknown watch event type")),
    }
}

/// A watch the server ends sooner than this with nothing sent counts as a failure.
const ENDED_AT_ONCE: Duration = Duration::from_secs(1);

fn decode_error(e: DecodeError) -> kube::Error {
    kube::Error::Service(Box::new(e))
}

/// The list request: a page of a consistent list, or the whole list from the watch cache.
fn list_request(
    label_selector: &str,
    list: ListFrom,
    next: &str,
) -> Result<http::Request<Vec<u8>>, kube::Error> {
    let mut params = ListParams::default().labels(label_selector);
    params = match list {
        ListFrom::Etcd { page_size } if next.is_empty() => params.limit(page_size),
        ListFrom::Etcd { page_size } => params.limit(page_size).continue_token(next),
        // `resourceVersion=0` alone, as client-go's informers list (any version, from the cache).
        ListFrom::Cache => params.at("0"),
    };
    Request::new(PATH)
        .list(&params)
        .map_err(kube::Error::BuildRequest)
}

/// The watch request from `version`, with bookmarks and the server-side timeout.
fn watch_request(
    label_selector: &str,
    version: &str,
) -> Result<http::Request<Vec<u8>>, kube::Error> {
    let params = WatchParams::default()
        .labels(label_selector)
        .timeout(WATCH_TIMEOUT_S);
    Request::new(PATH)
        .watch(&params, version)
        .map_err(kube::Error::BuildRequest)
}

/// Sends `req` (built by kube's `Request`) asking for `accept`.
async fn send(
    client: &Client,
    req: Result<http::Request<Vec<u8>>, kube::Error>,
    accept: &str,
) -> Result<http::Response<Body>, kube::Error> {
    let mut req = req?;
    let accept =
        http::HeaderValue::from_str(accept).map_err(|e| kube::Error::HttpError(e.into()))?;
    req.headers_mut().insert(http::header::ACCEPT, accept);
    client.send(req.map(Body::from)).await
}

fn content_type(res: &http::Response<Body>) -> &str {
    res.headers()
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
}

/// The `Status` of an error response: protobuf, JSON, or else its text.
fn error_status(code: http::StatusCode, body: &[u8]) -> Status {
    if let Ok(env) = protobuf::envelope(body)
        && let Ok(mut s) = protobuf::status(env.raw)
    {
        if s.code == 0 {
            s.code = code.as_u16();
        }
        return s;
    }
    if let Ok(s) = serde_json::from_slice::<Status>(body) {
        return s;
    }
    let text = String::from_utf8_lossy(body);
    Status::failure(text.trim(), "Failed to parse error data").with_code(code.as_u16())
}

/// The next list page, fetched in a task of its own; aborted when dropped (the stream was
/// dropped, or the list failed).
struct Prefetch(tokio::task::JoinHandle<Result<bytes::Bytes, kube::Error>>);

impl Prefetch {
    fn start(client: &Client, label_selector: &str, list: ListFrom, next: &str) -> Self {
        let (client, label_selector, next) =
            (client.clone(), label_selector.to_owned(), next.to_owned());
        Self(tokio::spawn(async move {
            list_body(&client, &label_selector, list, &next).await
        }))
    }

    async fn get(mut self) -> Result<bytes::Bytes, kube::Error> {
        match (&mut self.0).await {
            Ok(r) => r,
            Err(e) => Err(kube::Error::Service(Box::new(e))),
        }
    }
}

impl Drop for Prefetch {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A list request sent, its response's status checked: the body still to be read.
async fn open_list(
    client: &Client,
    label_selector: &str,
    list: ListFrom,
    next: &str,
) -> Result<Body, kube::Error> {
    let res = send(
        client,
        list_request(label_selector, list, next),
        protobuf::MEDIA_TYPE,
    )
    .await?;
    let status = res.status();
    if !status.is_success() {
        let body = res.into_body().collect_bytes().await?;
        return Err(kube::Error::Api(error_status(status, &body).boxed()));
    }
    Ok(res.into_body())
}

/// One list response's body, whole (a prefetched page).
async fn list_body(
    client: &Client,
    label_selector: &str,
    list: ListFrom,
    next: &str,
) -> Result<bytes::Bytes, kube::Error> {
    open_list(client, label_selector, list, next)
        .await?
        .collect_bytes()
        .await
}

/// How much of a prefetched page is decoded at a time (so the decoder's buffer stays small).
const FETCHED_PIECE: usize = 64 << 10;

/// A list response being decoded: read as its body arrives, or already fetched whole.
struct ListBody {
    parts: protobuf::ListStream,
    live: Option<Body>,
    fetched: bytes::Bytes,
}

impl ListBody {
    fn live(body: Body) -> Self {
        Self {
            parts: protobuf::ListStream::default(),
            live: Some(body),
            fetched: bytes::Bytes::new(),
        }
    }

    fn fetched(body: bytes::Bytes) -> Self {
        Self {
            parts: protobuf::ListStream::default(),
            live: None,
            fetched: body,
        }
    }

    /// The next part of the list; `None` after the last, once the whole body was read and
    /// was a whole list.
    async fn next_part(&mut self) -> Result<Option<ListPart>, kube::Error> {
        loop {
            if let Some(part) = self.parts.next_part().map_err(decode_error)? {
                return Ok(Some(part));
            }
            if !self.fetched.is_empty() {
                let piece = self.fetched.split_to(self.fetched.len().min(FETCHED_PIECE));
                self.parts.feed(&piece);
                continue;
            }
            let Some(body) = &mut self.live else {
                self.parts.finish().map_err(decode_error)?;
                return Ok(None);
            };
            match body.frame().await {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.parts.feed(&data);
                    }
                }
                Some(Err(e)) => return Err(e),
                None => self.live = None,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_carry_the_selector_pages_cache_and_watch_parameters() {
        let uri = |r: Result<http::Request<Vec<u8>>, kube::Error>| r.unwrap().uri().to_string();
        let sel = "multicluster.kubernetes.io/service-name";
        let page = uri(list_request(
            sel,
            ListFrom::Etcd { page_size: 5000 },
            "tok/en=",
        ));
        assert!(
            page.starts_with("/apis/discovery.k8s.io/v1/endpointslices?"),
            "{page}"
        );
        for part in [
            "labelSelector=multicluster.kubernetes.io%2Fservice-name",
            "limit=5000",
            "continue=tok%2Fen%3D",
        ] {
            assert!(page.contains(part), "{page} lacks {part}");
        }
        let cached = uri(list_request(sel, ListFrom::Cache, ""));
        assert!(cached.ends_with("&resourceVersion=0"), "{cached}");
        assert!(!cached.contains("limit"), "{cached}");
        let watch = uri(watch_request(sel, "42"));
        for part in [
            "watch=true",
            "timeoutSeconds=290",
            "allowWatchBookmarks=true",
            "resourceVersion=42",
        ] {
            assert!(watch.contains(part), "{watch} lacks {part}");
        }
    }

    #[test]
    fn error_bodies_give_their_status_in_either_encoding() {
        use protobuf::encode::*;
        let pb = envelope(
            "Status",
            &cat(&[s(3, "continue token expired"), s(4, "Expired"), n(6, 410)]),
        );
        let st = error_status(http::StatusCode::GONE, &pb);
        assert_eq!((st.code, st.reason.as_str()), (410, "Expired"));
        let json = br#"{"kind":"Status","code":403,"reason":"Forbidden","message":"no"}"#;
        assert_eq!(error_status(http::StatusCode::FORBIDDEN, json).code, 403);
        let text = error_status(http::StatusCode::BAD_GATEWAY, b"upstream down");
        assert_eq!((text.code, text.message.as_str()), (502, "upstream down"));
    }
}
