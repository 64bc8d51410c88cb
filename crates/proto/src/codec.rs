//! Frame codec. Every message travels as one frame on a byte stream (a QUIC stream or a TCP
//! connection):
//!
//! ```text
//! u32 length of the rest (little endian) | u8 kind | u64 call id | u16 method | body
//! ```
//!
//! A request body is the postcard-encoded `RequestHeader` followed by the request; a reply body
//! is the reply (kind `REPLY_OK`) or a `RemoteError` (kind `REPLY_ERR`). The call id only pairs a
//! reply with its request on one connection; idempotency uses the header's request id.

use crate::{ProtoError, RemoteError, RequestHeader, Rpc};
use serde::{de::DeserializeOwned, Serialize};

pub const KIND_REQUEST: u8 = 0;
pub const KIND_REPLY_OK: u8 = 1;
pub const KIND_REPLY_ERR: u8 = 2;

/// Bytes of the fixed part after the length prefix.
pub const FRAME_FIXED: usize = 1 + 8 + 2;
/// Largest frame accepted; a larger length prefix closes the connection.
pub const MAX_FRAME: usize = 20 << 20;
/// Largest data payload of one chunk request; clients split larger I/O.
pub const MAX_IO: usize = 4 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHead {
    pub kind: u8,
    pub call_id: u64,
    pub method: u16,
}

impl FrameHead {
    /// Parses the fixed part of a frame (after the length prefix).
    pub fn parse(frame: &[u8]) -> Result<(FrameHead, &[u8]), ProtoError> {
        if frame.len() < FRAME_FIXED {
            return Err(ProtoError::Truncated);
        }
        let kind = frame[0];
        if kind > KIND_REPLY_ERR {
            return Err(ProtoError::BadKind(kind));
        }
        let call_id = u64::from_le_bytes(frame[1..9].try_into().unwrap());
        let method = u16::from_le_bytes(frame[9..11].try_into().unwrap());
        Ok((FrameHead { kind, call_id, method }, &frame[FRAME_FIXED..]))
    }
}

fn start_frame(kind: u8, call_id: u64, method: u16, body_hint: usize) -> Vec<u8> {
    let mut buf = Vec::with_capacity(4 + FRAME_FIXED + body_hint);
    buf.extend_from_slice(&[0u8; 4]);
    buf.push(kind);
    buf.extend_from_slice(&call_id.to_le_bytes());
    buf.extend_from_slice(&method.to_le_bytes());
    buf
}

fn finish_frame(mut buf: Vec<u8>) -> Result<Vec<u8>, ProtoError> {
    let len = buf.len() - 4;
    if len > MAX_FRAME {
        return Err(ProtoError::FrameTooLarge(len, MAX_FRAME));
    }
    buf[..4].copy_from_slice(&(len as u32).to_le_bytes());
    Ok(buf)
}

fn append<T: Serialize>(buf: Vec<u8>, value: &T) -> Result<Vec<u8>, ProtoError> {
    Ok(postcard::to_extend(value, buf)?)
}

/// Encodes a whole request frame, length prefix included.
pub fn encode_request<R: Rpc>(call_id: u64, header: &RequestHeader, req: &R) -> Result<Vec<u8>, ProtoError> {
    let buf = start_frame(KIND_REQUEST, call_id, R::METHOD, 64);
    let buf = append(buf, header)?;
    finish_frame(append(buf, req)?)
}

/// Encodes a whole reply frame, serialising the reply straight into the frame buffer (chunk
/// data is copied once, not twice).
pub fn encode_reply<T: Serialize>(call_id: u64, method: u16, result: &Result<T, RemoteError>) -> Vec<u8> {
    match result {
        Ok(v) => match postcard::to_extend(v, start_frame(KIND_REPLY_OK, call_id, method, 64))
            .map_err(ProtoError::from)
            .and_then(finish_frame)
        {
            Ok(f) => f,
            Err(e) => encode_error(call_id, method, &e.into()),
        },
        Err(e) => encode_error(call_id, method, e),
    }
}

fn encode_error(call_id: u64, method: u16, e: &RemoteError) -> Vec<u8> {
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
    finish_frame(buf).expect("an error frame is far below the frame limit")
}

/// Decodes a request body into its header and request.
pub fn decode_request<R: DeserializeOwned>(body: &[u8]) -> Result<(RequestHeader, R), ProtoError> {
    let (header, rest) = postcard::take_from_bytes::<RequestHeader>(body)?;
    let req = postcard::from_bytes::<R>(rest)?;
    Ok((header, req))
}

/// Decodes just the header of a request body.
pub fn decode_header(body: &[u8]) -> Result<(RequestHeader, &[u8]), ProtoError> {
    Ok(postcard::take_from_bytes::<RequestHeader>(body)?)
}

/// Decodes a reply frame's body according to its kind.
pub fn decode_reply<T: DeserializeOwned>(kind: u8, body: &[u8]) -> Result<T, RemoteError> {
    match kind {
        KIND_REPLY_OK => postcard::from_bytes(body).map_err(|e| ProtoError::from(e).into()),
        KIND_REPLY_ERR => Err(postcard::from_bytes::<RemoteError>(body).unwrap_or_else(|e| ProtoError::from(e).into())),
        k => Err(ProtoError::BadKind(k).into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta::{Attr, Lookup};
    use crate::ErrorCode;

    #[test]
    fn request_round_trip() {
        let h = RequestHeader { request_id: 7, client_id: 9, uid: 1000, gid: 100, groups: vec![4, 5] };
        let req = Lookup { parent: crate::InodeId::ROOT, name: b"x".to_vec() };
        let frame = encode_request(42, &h, &req).unwrap();
        let len = u32::from_le_bytes(frame[..4].try_into().unwrap()) as usize;
        assert_eq!(len, frame.len() - 4);
        let (head, body) = FrameHead::parse(&frame[4..]).unwrap();
        assert_eq!(head, FrameHead { kind: KIND_REQUEST, call_id: 42, method: 100 });
        let (h2, r2): (RequestHeader, Lookup) = decode_request(body).unwrap();
        assert_eq!(h2, h);
        assert_eq!(r2, req);
    }

    #[test]
    fn error_reply_round_trip() {
        let r: Result<Attr, RemoteError> = Err(RemoteError::new(ErrorCode::NotEmpty, "d"));
        let frame = encode_reply(5, 100, &r);
        let (head, body) = FrameHead::parse(&frame[4..]).unwrap();
        assert_eq!(head, FrameHead { kind: KIND_REPLY_ERR, call_id: 5, method: 100 });
        let got = decode_reply::<Attr>(head.kind, body).unwrap_err();
        assert_eq!(got.code, ErrorCode::NotEmpty);
        let ok: Result<Vec<u8>, RemoteError> = Ok(vec![7; 1000]);
        let frame = encode_reply(6, 201, &ok);
        let (head, body) = FrameHead::parse(&frame[4..]).unwrap();
        assert_eq!(decode_reply::<Vec<u8>>(head.kind, body).unwrap(), vec![7; 1000]);
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        for n in 0..64u8 {
            let junk: Vec<u8> = (0..n).map(|i| i.wrapping_mul(37).wrapping_add(n)).collect();
            let _ = FrameHead::parse(&junk);
            let _ = decode_request::<Lookup>(&junk);
            let _ = decode_reply::<Attr>(KIND_REPLY_OK, &junk);
        }
    }

    #[test]
    fn method_ids_are_unique() {
        let mut all: Vec<u16> =
            [crate::mgmt::METHOD_IDS, crate::meta::METHOD_IDS, crate::storage::METHOD_IDS, crate::stage::METHOD_IDS]
                .concat();
        let n = all.len();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), n);
    }
}
