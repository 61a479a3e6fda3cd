//! A Retry offload (draft-ietf-quic-retry-offload): something in front of QUIC servers, such
//! as a load balancer, that validates client addresses with Retry (RFC 9000 §8.1.2) before a
//! handshake reaches a server. It keeps no state per client: a client's first Initial is
//! answered with a Retry whose token seals the client's address, the Initial's destination
//! connection ID and the Retry's source connection ID under a [`TokenKey`]; an Initial that
//! brings such a token back, from that address and sent to that ID, is passed on.
//!
//! The servers behind it share the key (`ServerConfig::token_key`) and set
//! `ServerConfig::retry_offload`: they read the token to fill in the
//! original_destination_connection_id and retry_source_connection_id transport parameters
//! (RFC 9000 §7.3), without comparing its address with the one they see the client at (a
//! full proxy's). This is the draft's shared-state service.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::cid::ConnectionId;
use crate::token::{self, TokenError, TokenKey, ValidToken};
use crate::types::Version;

/// A client's Initial as the offload reads it: the IDs a Retry answers with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InitialIds {
    /// Its version.
    pub version: Version,
    /// Its destination connection ID (chosen by the client, at least 8 bytes).
    pub dcid: ConnectionId,
    /// Its source connection ID.
    pub scid: ConnectionId,
}

/// What to do with a datagram (see [`RetryOffload::check`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Verdict {
    /// Its first packet is not a client Initial of a version the offload speaks (a short
    /// header, another long-header type, another version), or is a later Initial of a
    /// connection under way (its token valid for the address, sent to the server's own ID;
    /// or, without a token, to an ID under 8 bytes, which only a server chooses): not the
    /// offload's to judge.
    NotInitial,
    /// An Initial with a token this offload sealed, from the address it was sealed for and
    /// sent to the Retry's ID: the client's address is validated; pass it on.
    Validated,
    /// An Initial without a token, or with one this offload did not seal (a server's
    /// NEW_TOKEN token, say): answer it with [`RetryOffload::retry`] to validate it.
    Unvalidated(InitialIds),
    /// An Initial with a Retry token this offload sealed for another address (a copy), or
    /// sent to the Retry's ID too long after it (a client that took too long): answer with
    /// this Initial packet closing the attempt with INVALID_TOKEN (RFC 9000 §8.1.2; a few
    /// dozen bytes, it amplifies nothing) and pass nothing on.
    InvalidToken(Vec<u8>),
    /// An Initial to drop: in a datagram under 1200 bytes (RFC 9000 §14.1).
    Drop,
}

/// A stateless Retry service (see the [module](self) docs).
#[derive(Clone)]
pub struct RetryOffload {
    key: Arc<TokenKey>,
    lifetime: Duration,
}

impl std::fmt::Debug for RetryOffload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RetryOffload")
            .field("lifetime", &self.lifetime)
            .finish_non_exhaustive()
    }
}

impl RetryOffload {
    /// Tokens sealed with `key` (the servers' `token_key`), valid for `lifetime` (the
    /// servers' `retry_token_lifetime` or less).
    pub fn new(key: Arc<TokenKey>, lifetime: Duration) -> Self {
        Self { key, lifetime }
    }

    /// Judges a datagram `client` sent; `unix_ms` is the wall-clock time.
    pub fn check(&self, datagram: &[u8], client: SocketAddr, unix_ms: u64) -> Verdict {
        let Some((ids, token)) = parse_initial(datagram) else {
            return Verdict::NotInitial;
        };
        // RFC 9000 §14.1: a client's Initial fills a datagram of 1200 bytes; a shorter one
        // would have the Retry amplify what a spoofed source sent.
        if datagram.len() < MIN_INITIAL_DATAGRAM {
            return Verdict::Drop;
        }
        // RFC 9000 §7.2: a client's first destination ID is at least 8 bytes. A shorter
        // one without a Retry token is a server's (shorter IDs are allowed there): an
        // Initial of a handshake under way, which reaches its connection by that ID and
        // is not the offload's to answer (nor to drop: its datagram may carry the
        // client's Handshake packets too).
        let opening = |ids: InitialIds| {
            if ids.dcid.len() < 8 {
                Verdict::NotInitial
            } else {
                Verdict::Unvalidated(ids)
            }
        };
        if token.is_empty() {
            return opening(ids);
        }
        // The address is checked (the offload sees the client's own), the age not yet: a
        // client includes the token in every Initial after the Retry (RFC 9000 §17.2.5.3),
        // those of a handshake under way too, which go to the server's own ID and may come
        // after the token's lifetime.
        let open = |lifetime| {
            token::validate(
                &self.key,
                token,
                client,
                true,
                unix_ms,
                lifetime,
                Duration::MAX,
            )
        };
        match open(Duration::MAX) {
            // RFC 9000 §17.2.5.2: the first Initial after the Retry goes to the Retry's
            // source ID; it opens a connection if the token is still fresh.
            Ok(ValidToken::Retry { retry_scid, .. }) if retry_scid == ids.dcid => {
                match open(self.lifetime) {
                    Ok(_) => Verdict::Validated,
                    Err(_) => invalid_token(&ids),
                }
            }
            // A later Initial of a connection under way (to the server's ID): not the
            // offload's to judge; it opens nothing, it reaches the connection by its ID.
            Ok(ValidToken::Retry { .. }) => Verdict::NotInitial,
            // Sealed for another address: a copy.
            Err(TokenError::Stale) if token::is_retry_token(&self.key, token) => {
                invalid_token(&ids)
            }
            // A NEW_TOKEN token of the servers' (sealed with the same key): the offload does
            // not take them (it cannot tell whether one was used before).
            Ok(ValidToken::NewToken { .. }) | Err(_) => opening(ids),
        }
    }

    /// The Retry packet answering `initial` from `client`, sending it to `new_cid` (which
    /// should name the server its handshake will reach, for a balancer that routes by ID).
    pub fn retry(
        &self,
        initial: &InitialIds,
        client: SocketAddr,
        unix_ms: u64,
        new_cid: &ConnectionId,
    ) -> Vec<u8> {
        let tok = token::retry_token(&self.key, client, &initial.dcid, new_cid, unix_ms);
        crate::packet::build_retry(initial.version, &initial.scid, new_cid, &initial.dcid, &tok)
    }
}

/// The INVALID_TOKEN close answering `ids` (see [`Verdict::InvalidToken`]).
fn invalid_token(ids: &InitialIds) -> Verdict {
    let local = ConnectionId::random(&mut rand::rng(), 8);
    match crate::endpoint::initial_close(
        ids.version,
        &ids.dcid,
        &ids.scid,
        &local,
        crate::error::TransportErrorCode::INVALID_TOKEN,
        b"invalid token",
    ) {
        Some(p) => Verdict::InvalidToken(p),
        None => Verdict::Drop,
    }
}

/// The smallest datagram a client's Initial comes in (RFC 9000 §14.1).
const MIN_INITIAL_DATAGRAM: usize = 1200;

/// The Version Negotiation packet (RFC 9000 §6.1, §17.2.1) answering a datagram whose first
/// packet is a long header of a version kuai does not speak (neither 1 nor 2, nor 0), in a
/// datagram of 1200 bytes or more as a client's first one is; `None` for anything else.
/// For an offload that stands in front of servers of those versions and opens nothing for
/// other packets.
pub fn version_negotiation(datagram: &[u8]) -> Option<Vec<u8>> {
    let first = *datagram.first()?;
    if first & 0x80 == 0 || datagram.len() < MIN_INITIAL_DATAGRAM {
        return None;
    }
    let version = u32::from_be_bytes(datagram.get(1..5)?.try_into().ok()?);
    if version == 0 || Version::from_wire(version).is_some() {
        return None;
    }
    // RFC 8999 §5.1: the IDs' layout holds for every version.
    let dcid_len = usize::from(*datagram.get(5)?);
    let dcid = datagram.get(6..6 + dcid_len)?;
    let scid_len = usize::from(*datagram.get(6 + dcid_len)?);
    let scid = datagram.get(7 + dcid_len..7 + dcid_len + scid_len)?;
    Some(crate::packet::build_version_negotiation(
        scid,
        dcid,
        &[Version::V1.wire(), Version::V2.wire()],
    ))
}

/// The IDs and token of a datagram's first packet if it is a client Initial of version 1 or
/// 2 (RFC 9000 §17.2.2, RFC 9369 §3.2); the rest of the packet is not read.
fn parse_initial(d: &[u8]) -> Option<(InitialIds, &[u8])> {
    let first = *d.first()?;
    if first & 0x80 == 0 {
        return None;
    }
    let version = Version::from_wire(u32::from_be_bytes(d.get(1..5)?.try_into().ok()?))?;
    let initial_bits = match version {
        Version::V1 => 0,
        Version::V2 => 1,
    };
    if (first >> 4) & 3 != initial_bits {
        return None;
    }
    let mut at = 5;
    let mut cid = || {
        let len = usize::from(*d.get(at)?);
        let id = ConnectionId::try_from_slice(d.get(at + 1..at + 1 + len)?)?;
        at += 1 + len;
        Some(id)
    };
    let dcid = cid()?;
    let scid = cid()?;
    let mut rest = d.get(at..)?;
    let len = crate::varint::VarInt::decode(&mut rest).ok()?.into_inner();
    let token = rest.get(..usize::try_from(len).ok()?)?;
    Some((
        InitialIds {
            version,
            dcid,
            scid,
        },
        token,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client Initial's header with this token (the payload is not read).
    fn initial(version: Version, dcid: &[u8], scid: &[u8], token: &[u8]) -> Vec<u8> {
        let bits = if version == Version::V1 { 0 } else { 1 };
        let mut d = vec![0xc0 | (bits << 4)];
        d.extend_from_slice(&version.wire().to_be_bytes());
        d.push(dcid.len() as u8);
        d.extend_from_slice(dcid);
        d.push(scid.len() as u8);
        d.extend_from_slice(scid);
        d.push(0x40 | (token.len() >> 8) as u8);
        d.push(token.len() as u8);
        d.extend_from_slice(token);
        d.resize(1200, 0);
        d
    }

    #[test]
    fn a_retry_validates_its_own_initial_only() {
        let key = Arc::new(TokenKey::random());
        let o = RetryOffload::new(key.clone(), Duration::from_secs(10));
        let client: SocketAddr = "192.0.2.1:5000".parse().unwrap();
        for version in [Version::V1, Version::V2] {
            let first = initial(version, &[1; 8], &[2; 5], &[]);
            let Verdict::Unvalidated(ids) = o.check(&first, client, 1000) else {
                panic!("no token, not unvalidated");
            };
            assert_eq!(ids.dcid, ConnectionId::new(&[1; 8]));
            let new = ConnectionId::new(&[9; 8]);
            let retry = o.retry(&ids, client, 1000, &new);
            assert!(crate::packet::retry_integrity_ok(
                version, &ids.dcid, &retry
            ));
            // The token sits between the IDs and the 16-byte tag.
            let token = &retry[1 + 4 + 1 + 5 + 1 + 8..retry.len() - 16];
            let second = initial(version, &new, &[2; 5], token);
            assert_eq!(o.check(&second, client, 2000), Verdict::Validated);
            // A later Initial of the connection, to the server's own ID, long after: not
            // judged (it goes by its ID).
            let later = initial(version, &[8; 8], &[2; 5], token);
            assert_eq!(o.check(&later, client, 60_000), Verdict::NotInitial);
            // After a Retry the client's ID is the Retry's, which may be shorter than 8.
            let short = ConnectionId::new(&[9; 6]);
            let retry = o.retry(&ids, client, 1000, &short);
            let token = &retry[1 + 4 + 1 + 5 + 1 + 6..retry.len() - 16];
            let to_short = initial(version, &short, &[2; 5], token);
            assert_eq!(o.check(&to_short, client, 2000), Verdict::Validated);
            // Another address, another ID, too late: closed with INVALID_TOKEN, in an Initial
            // of the client's version to its source ID.
            let elsewhere: SocketAddr = "192.0.2.2:5000".parse().unwrap();
            for v in [
                o.check(&second, elsewhere, 2000),
                o.check(&second, client, 12_000),
            ] {
                let Verdict::InvalidToken(p) = v else {
                    panic!("not closed: {v:?}");
                };
                assert_eq!((p[0] >> 4) & 3, if version == Version::V1 { 0 } else { 1 });
                assert_eq!(&p[1..5], &version.wire().to_be_bytes());
                assert_eq!(&p[5..11], &[5, 2, 2, 2, 2, 2]);
                assert!(p.len() < 100, "{} bytes", p.len());
            }
            // Another key's token: retried.
            let other = RetryOffload::new(Arc::new(TokenKey::random()), Duration::from_secs(10));
            assert!(matches!(
                other.check(&second, client, 2000),
                Verdict::Unvalidated(_)
            ));
        }
    }

    #[test]
    fn what_is_not_a_client_initial_is_not_judged() {
        let o = RetryOffload::new(Arc::new(TokenKey::random()), Duration::from_secs(10));
        let client: SocketAddr = "192.0.2.1:5000".parse().unwrap();
        let mut handshake = initial(Version::V1, &[1; 8], &[2; 5], &[]);
        handshake[0] = 0xe0;
        let mut unknown = initial(Version::V1, &[1; 8], &[2; 5], &[]);
        unknown[1..5].copy_from_slice(&0x1a2a_3a4au32.to_be_bytes());
        for d in [&[0x40u8; 50][..], &handshake, &unknown, &[], &[0xc0, 0, 0]] {
            assert_eq!(o.check(d, client, 0), Verdict::NotInitial);
        }
        // An ID under 8 bytes is no client's first (RFC 9000 §7.2): a server's, in a
        // handshake under way, whatever token comes with it but a Retry token of ours;
        // and an Initial in a short datagram (§14.1).
        let short = initial(Version::V1, &[1; 7], &[2; 5], &[]);
        assert_eq!(o.check(&short, client, 0), Verdict::NotInitial);
        let junk = initial(Version::V1, &[1; 7], &[2; 5], &[7; 40]);
        assert_eq!(o.check(&junk, client, 0), Verdict::NotInitial);
        let full = initial(Version::V1, &[1; 8], &[2; 5], &[]);
        assert_eq!(o.check(&full[..1199], client, 0), Verdict::Drop);
        // Versions it does not speak get Version Negotiation, others none.
        let vn = version_negotiation(&unknown).expect("no Version Negotiation");
        assert_eq!(&vn[1..5], &[0; 4]);
        assert_eq!(&vn[6..11], &[2; 5], "sent to the client's source ID");
        assert!(vn[12..].chunks(4).any(|v| v == [0, 0, 0, 1]));
        for d in [
            &full[..],
            &unknown[..1199],
            &handshake[..],
            &[0x40; 1200][..],
        ] {
            assert_eq!(version_negotiation(d), None);
        }
        // Cut inside its token.
        let cut = &initial(Version::V1, &[1; 8], &[2; 5], &[7; 100])[..60];
        assert_eq!(o.check(cut, client, 0), Verdict::NotInitial);
    }
}
