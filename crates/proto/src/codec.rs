//! Frame codec. Every message travels as one frame on a byte stream (a QUIC stream or a TCP
//! connection):
//!
//! ```text
//! u32 length of the rest (little endian) | u8 kind | u64 call id | u16 method |
//! u32 payload length | body | payload
//! ```
//!
//! A request body is the postcard-encoded `RequestHeader` followed by the request; a reply body
//! is the reply (kind `REPLY_OK`) or a `RemoteError` (kind `REPLY_ERR`). The call id only pairs a
//! reply with its request on one connection; idempotency uses the header's request id.
//!
//! The payload is a message's bulk bytes: a chunk write's data (`Rpc::payload`, shared with
//! the request so a retry sends it again) or a chunk read's (`Rpc::reply_payload`, moved out of
//! the reply). It is written after the body as a buffer of its own, and the receiver reads it
//! into a buffer of its own that becomes the decoded message's. A megabyte is then copied from
//! the socket once, not into a frame, out of it and out of postcard again. A sender's payload
//! may be several buffers ([`Payload`]: a chunk write gathered from pieces of an S3 response
//! body), written in one vectored write; the receiver gets them as one.
//!
//! A reply's payload may also be spans of files (`Rpc::reply_spans`, stored's chunk reads):
//! the sender's transport sends those bytes straight from the file (sendfile on TCP), after
//! the payload bytes, and the receiver reads them as any payload.

use crate::{ProtoError, RemoteError, RequestHeader, Rpc};
use bytes::Bytes;
use serde::Serialize;
use std::fs::File;
use std::sync::Arc;

pub const KIND_REQUEST: u8 = 0;
pub const KIND_REPLY_OK: u8 = 1;
pub const KIND_REPLY_ERR: u8 = 2;

/// Bytes of the fixed part after the length prefix.
pub const FRAME_FIXED: usize = 1 + 8 + 2 + 4;
/// Largest frame accepted; a larger length prefix closes the connection.
pub const MAX_FRAME: usize = 20 << 20;
/// Largest data payload of one chunk request; clients split larger I/O.
pub const MAX_IO: usize = 4 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHead {
    pub kind: u8,
    pub call_id: u64,
    pub method: u16,
    /// Bytes of payload at the end of the frame.
    pub payload: u32,
}

impl FrameHead {
    /// Parses the fixed part of a frame of `len` bytes (after the length prefix), checking
    /// that the payload fits in it.
    pub fn parse(fixed: &[u8], len: usize) -> Result<FrameHead, ProtoError> {
        if fixed.len() < FRAME_FIXED || len < FRAME_FIXED {
            return Err(ProtoError::Truncated);
        }
        let kind = fixed[0];
        if kind > KIND_REPLY_ERR {
            return Err(ProtoError::BadKind(kind));
        }
        let call_id = u64::from_le_bytes(fixed[1..9].try_into().unwrap());
        let method = u16::from_le_bytes(fixed[9..11].try_into().unwrap());
        let payload = u32::from_le_bytes(fixed[11..15].try_into().unwrap());
        if payload as usize > len - FRAME_FIXED {
            return Err(ProtoError::Truncated);
        }
        Ok(FrameHead { kind, call_id, method, payload })
    }

    /// Bytes of body in a frame of `len` bytes.
    pub fn body_len(&self, len: usize) -> usize {
        len - FRAME_FIXED - self.payload as usize
    }
}

/// `len` bytes of a file at `offset`, sent as part of a frame's payload by the sender's
/// transport without passing through a buffer of its own (sendfile on TCP). Where the file
/// ends before `len` (it shrank after the length was taken), the rest is sent as zeros so the
/// stream stays framed.
#[derive(Debug, Clone)]
pub struct FileSpan {
    pub file: Arc<File>,
    pub offset: u64,
    pub len: u32,
}

impl PartialEq for FileSpan {
    fn eq(&self, o: &FileSpan) -> bool {
        Arc::ptr_eq(&self.file, &o.file) && self.offset == o.offset && self.len == o.len
    }
}

impl Eq for FileSpan {}

/// A message's bulk bytes as one or more buffers, sent back to back: a sender hands over the
/// pieces it holds (an S3 body's, shared) instead of copying them together first. Received
/// payloads are always one buffer.
#[derive(Clone, Default)]
pub struct Payload(Vec<Bytes>);

impl Payload {
    pub fn len(&self) -> usize {
        self.0.iter().map(Bytes::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        // `push` keeps no empty piece.
        self.0.is_empty()
    }

    pub fn pieces(&self) -> &[Bytes] {
        &self.0
    }

    /// Appends `piece` (empty pieces are dropped).
    pub fn push(&mut self, piece: Bytes) {
        if !piece.is_empty() {
            self.0.push(piece);
        }
    }

    /// The bytes in one buffer: the piece itself when there is one (as received), else copied
    /// together.
    pub fn contiguous(&self) -> Bytes {
        match self.0.as_slice() {
            [] => Bytes::new(),
            [one] => one.clone(),
            many => many.concat().into(),
        }
    }

    fn bytes(&self) -> impl Iterator<Item = &u8> {
        self.0.iter().flat_map(|p| p.iter())
    }
}

impl From<Bytes> for Payload {
    fn from(b: Bytes) -> Payload {
        let mut p = Payload::default();
        p.push(b);
        p
    }
}

impl From<Vec<u8>> for Payload {
    fn from(v: Vec<u8>) -> Payload {
        Bytes::from(v).into()
    }
}

/// Equal when the bytes are, however they are divided into pieces.
impl PartialEq for Payload {
    fn eq(&self, o: &Payload) -> bool {
        self.len() == o.len() && self.bytes().eq(o.bytes())
    }
}

impl Eq for Payload {}

impl PartialEq<Vec<u8>> for Payload {
    fn eq(&self, o: &Vec<u8>) -> bool {
        self.len() == o.len() && self.bytes().eq(o.iter())
    }
}

/// The length and the pieces' count: a megabyte of bytes in a log line helps nobody.
impl std::fmt::Debug for Payload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Payload({} bytes in {} pieces)", self.len(), self.0.len())
    }
}

/// An encoded frame: length prefix, fixed part and body in `head`, then `payload` (often
/// empty), written after it as it is, then the bytes of `spans`, if any.
#[derive(Debug)]
pub struct Frame {
    pub head: Vec<u8>,
    pub payload: Payload,
    pub spans: Vec<FileSpan>,
}

impl Frame {
    /// Bytes after the body: the payload and the spans.
    pub fn payload_len(&self) -> usize {
        self.payload.len() + spans_len(&self.spans)
    }
}

fn spans_len(spans: &[FileSpan]) -> usize {
    spans.iter().map(|s| s.len as usize).sum()
}

fn start_frame(kind: u8, call_id: u64, method: u16, body_hint: usize) -> Vec<u8> {
    let mut buf = Vec::with_capacity(4 + FRAME_FIXED + body_hint);
    buf.extend_from_slice(&[0u8; 4]);
    buf.push(kind);
    buf.extend_from_slice(&call_id.to_le_bytes());
    buf.extend_from_slice(&method.to_le_bytes());
    buf.extend_from_slice(&[0u8; 4]);
    buf
}

fn finish_frame(mut head: Vec<u8>, payload: Payload, spans: Vec<FileSpan>) -> Result<Frame, ProtoError> {
    let after = payload.len() + spans_len(&spans);
    let len = head.len() - 4 + after;
    if len > MAX_FRAME {
        return Err(ProtoError::FrameTooLarge(len, MAX_FRAME));
    }
    head[..4].copy_from_slice(&(len as u32).to_le_bytes());
    head[4 + 11..4 + FRAME_FIXED].copy_from_slice(&(after as u32).to_le_bytes());
    Ok(Frame { head, payload, spans })
}

fn append<T: Serialize>(buf: Vec<u8>, value: &T) -> Result<Vec<u8>, ProtoError> {
    Ok(postcard::to_extend(value, buf)?)
}

/// Encodes a whole request frame, length prefix included; the request's payload is shared,
/// not copied.
pub fn encode_request<R: Rpc>(call_id: u64, header: &RequestHeader, req: &R) -> Result<Frame, ProtoError> {
    let buf = start_frame(KIND_REQUEST, call_id, R::METHOD, 64);
    let buf = append(buf, header)?;
    finish_frame(append(buf, req)?, req.payload().cloned().unwrap_or_default(), Vec::new())
}

/// Encodes the reply frame of request type `R`: the reply's payload moves into the frame's,
/// the rest is serialised into the frame buffer.
pub fn encode_reply<R: Rpc>(call_id: u64, result: Result<R::Reply, RemoteError>) -> Frame {
    match result {
        Ok(mut v) => {
            let payload = R::reply_payload(&mut v).map(std::mem::take).unwrap_or_default().into();
            let spans = R::reply_spans(&mut v).map(std::mem::take).unwrap_or_default();
            match postcard::to_extend(&v, start_frame(KIND_REPLY_OK, call_id, R::METHOD, 64))
                .map_err(ProtoError::from)
                .and_then(|head| finish_frame(head, payload, spans))
            {
                Ok(f) => f,
                Err(e) => encode_error(call_id, R::METHOD, &e.into()),
            }
        }
        Err(e) => encode_error(call_id, R::METHOD, &e),
    }
}

/// Encodes an error reply frame.
pub fn encode_error(call_id: u64, method: u16, e: &RemoteError) -> Frame {
    let mut e = e.clone();
    if e.message.len() > 4096 {
        let mut cut = 4096;
        while !e.message.is_char_boundary(cut) {
            cut -= 1;
        }
        e.message.truncate(cut);
    }
    let buf = postcard::to_extend(&e, start_frame(KIND_REPLY_ERR, call_id, method, 64))
        .expect("serialising into a Vec cannot fail");
    finish_frame(buf, Payload::default(), Vec::new()).expect("an error frame is far below the frame limit")
}

/// Decodes a request frame's body and payload into its header and request.
pub fn decode_request<R: Rpc>(body: &[u8], payload: Bytes) -> Result<(RequestHeader, R), ProtoError> {
    let (header, rest) = postcard::take_from_bytes::<RequestHeader>(body)?;
    let mut req = postcard::from_bytes::<R>(rest)?;
    if !payload.is_empty() {
        *req.payload_mut().ok_or(ProtoError::UnexpectedPayload(R::NAME))? = payload.into();
    }
    Ok((header, req))
}

/// Decodes just the header of a request body.
pub fn decode_header(body: &[u8]) -> Result<(RequestHeader, &[u8]), ProtoError> {
    Ok(postcard::take_from_bytes::<RequestHeader>(body)?)
}

/// Decodes the reply to request type `R` from a frame's kind, body and payload.
pub fn decode_reply<R: Rpc>(kind: u8, body: &[u8], payload: Vec<u8>) -> Result<R::Reply, RemoteError> {
    match kind {
        KIND_REPLY_OK => {
            let mut v: R::Reply = postcard::from_bytes(body).map_err(ProtoError::from)?;
            if !payload.is_empty() {
                match R::reply_payload(&mut v) {
                    Some(slot) => *slot = payload,
                    None => return Err(ProtoError::UnexpectedPayload(R::NAME).into()),
                }
            }
            Ok(v)
        }
        KIND_REPLY_ERR => Err(postcard::from_bytes::<RemoteError>(body).unwrap_or_else(|e| ProtoError::from(e).into())),
        k => Err(ProtoError::BadKind(k).into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta::Lookup;
    use crate::storage::{ChunkData, ReadChunk, StatChunk, WriteChunk};
    use crate::ErrorCode;

    /// Splits an encoded frame as a receiver reads it: head, body, payload.
    fn receive(f: &Frame) -> (FrameHead, Vec<u8>, Vec<u8>) {
        let len = u32::from_le_bytes(f.head[..4].try_into().unwrap()) as usize;
        assert_eq!(len, f.head.len() - 4 + f.payload.len());
        let head = FrameHead::parse(&f.head[4..4 + FRAME_FIXED], len).unwrap();
        let body = f.head[4 + FRAME_FIXED..].to_vec();
        assert_eq!(body.len(), head.body_len(len));
        assert_eq!(head.payload as usize, f.payload.len());
        (head, body, f.payload.contiguous().to_vec())
    }

    #[test]
    fn request_round_trip() {
        let h = RequestHeader { request_id: 7, client_id: 9, uid: 1000, gid: 100, groups: vec![4, 5] };
        let req = Lookup { parent: crate::InodeId::ROOT, name: b"x".to_vec() };
        let frame = encode_request(42, &h, &req).unwrap();
        let (head, body, payload) = receive(&frame);
        assert_eq!(head, FrameHead { kind: KIND_REQUEST, call_id: 42, method: 100, payload: 0 });
        let (h2, r2): (RequestHeader, Lookup) = decode_request(&body, payload.into()).unwrap();
        assert_eq!(h2, h);
        assert_eq!(r2, req);
    }

    #[test]
    fn error_reply_round_trip() {
        let frame = encode_reply::<Lookup>(5, Err(RemoteError::new(ErrorCode::NotEmpty, "d")));
        let (head, body, payload) = receive(&frame);
        assert_eq!(head, FrameHead { kind: KIND_REPLY_ERR, call_id: 5, method: 100, payload: 0 });
        let got = decode_reply::<Lookup>(head.kind, &body, payload).unwrap_err();
        assert_eq!(got.code, ErrorCode::NotEmpty);
    }

    #[test]
    fn write_data_travels_as_the_payload() {
        let h = RequestHeader { request_id: 1, ..Default::default() };
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 249) as u8).collect();
        let req = WriteChunk {
            target: 3,
            ino: crate::InodeId(9),
            offset: 4096,
            data: data.clone().into(),
            sync: true,
            crc: false,
        };
        let frame = encode_request(1, &h, &req).unwrap();
        assert_eq!(frame.payload, data, "the data is the frame's payload");
        assert!(frame.head.len() < 64, "and not in its body ({} bytes)", frame.head.len());
        let (head, body, payload) = receive(&frame);
        assert_eq!(head.payload as usize, data.len());
        let (_, got): (RequestHeader, WriteChunk) = decode_request(&body, payload.into()).unwrap();
        assert_eq!(got, req);
        // A payload on a request that has no place for one is refused, not dropped.
        let lookup = encode_request(2, &h, &Lookup { parent: crate::InodeId::ROOT, name: b"x".to_vec() }).unwrap();
        let (_, body, _) = receive(&lookup);
        let e = decode_request::<Lookup>(&body, vec![1].into()).unwrap_err();
        assert!(e.to_string().contains("payload"), "{e}");
    }

    #[test]
    fn chunk_data_travels_as_the_payload() {
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let frame = encode_reply::<ReadChunk>(6, Ok(ChunkData { data: data.clone(), ..Default::default() }));
        assert_eq!(frame.payload, data, "the data is the frame's payload");
        assert!(frame.head.len() < 64, "and not in its body ({} bytes)", frame.head.len());
        let (head, body, payload) = receive(&frame);
        assert_eq!(decode_reply::<ReadChunk>(head.kind, &body, payload).unwrap().data, data);
        // An empty read has no payload and decodes to no data.
        let (head, body, payload) = receive(&encode_reply::<ReadChunk>(7, Ok(ChunkData::default())));
        assert_eq!(decode_reply::<ReadChunk>(head.kind, &body, payload).unwrap().data, Vec::<u8>::new());
        // A payload on a reply that has no place for one is refused, not dropped.
        let (head, body, _) = receive(&encode_reply::<StatChunk>(8, Ok(Some(5))));
        let e = decode_reply::<StatChunk>(head.kind, &body, vec![1, 2, 3]).unwrap_err();
        assert_eq!(e.code, ErrorCode::BadMessage);
        assert!(e.message.contains("payload"), "{}", e.message);
    }

    #[test]
    fn file_spans_count_in_the_payload_length() {
        let file = Arc::new(File::open("/dev/null").unwrap());
        let span = |offset, len| FileSpan { file: file.clone(), offset, len };
        let reply = crate::storage::ChunksData {
            lens: vec![Some(10), Some(0), Some(5)],
            spans: vec![span(0, 10), span(4096, 5)],
            ..Default::default()
        };
        let frame = encode_reply::<crate::storage::ReadChunks>(9, Ok(reply));
        assert!(frame.payload.is_empty());
        assert_eq!(frame.payload_len(), 15);
        assert_eq!(frame.spans, vec![span(0, 10), span(4096, 5)], "sent as they are, in order");
        let len = u32::from_le_bytes(frame.head[..4].try_into().unwrap()) as usize;
        assert_eq!(len, frame.head.len() - 4 + 15, "the length prefix counts the spans' bytes");
        let head = FrameHead::parse(&frame.head[4..4 + FRAME_FIXED], len).unwrap();
        assert_eq!(head.payload, 15);
        // The body is what it would be with the bytes in `data`: the receiver decodes the lens.
        let body = &frame.head[4 + FRAME_FIXED..];
        let got = decode_reply::<crate::storage::ReadChunks>(head.kind, body, vec![7; 15]).unwrap();
        assert_eq!((got.lens, got.data.len()), (vec![Some(10), Some(0), Some(5)], 15));
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        for n in 0..64u8 {
            let junk: Vec<u8> = (0..n).map(|i| i.wrapping_mul(37).wrapping_add(n)).collect();
            let _ = FrameHead::parse(&junk, junk.len());
            let _ = FrameHead::parse(&junk, usize::from(n) * 1000);
            let _ = decode_request::<Lookup>(&junk, Bytes::new());
            let _ = decode_request::<WriteChunk>(&junk, junk.clone().into());
            let _ = decode_reply::<Lookup>(KIND_REPLY_OK, &junk, junk.clone());
        }
        // A payload longer than the frame is refused.
        let mut fixed = [0u8; FRAME_FIXED];
        fixed[11..15].copy_from_slice(&100u32.to_le_bytes());
        assert!(FrameHead::parse(&fixed, FRAME_FIXED + 99).is_err());
        assert!(FrameHead::parse(&fixed, FRAME_FIXED + 100).is_ok());
    }

    #[test]
    fn method_ids_are_unique() {
        let mut all: Vec<u16> = [
            crate::mgmt::METHOD_IDS,
            crate::meta::METHOD_IDS,
            crate::storage::METHOD_IDS,
            crate::stage::METHOD_IDS,
            crate::stats::METHOD_IDS,
        ]
        .concat();
        let n = all.len();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), n);
    }
}
