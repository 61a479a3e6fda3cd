//! The fleet's shared secrets: the stateless-reset key (any server can reset a connection
//! another held, RFC 9000 §10.3.2) and the Retry / NEW_TOKEN token key (a token one server
//! issued validates at another).

use std::time::Duration;

use crate::{FleetError, Link};

/// Redis key names.
const RESET_KEY: &str = "kuai:keys:stateless-reset";
const TOKEN_KEY: &str = "kuai:keys:address-token";

/// The fleet's secrets.
#[derive(Clone)]
pub struct SharedKeys {
    /// The stateless-reset key (`kuai::EndpointBuilder::reset_key`).
    pub reset: [u8; 32],
    /// The Retry / NEW_TOKEN token key (`kuai::ServerConfig::token_secret`).
    pub token: [u8; 32],
}

impl std::fmt::Debug for SharedKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedKeys")
            .field("reset", &key_id(&self.reset))
            .field("token", &key_id(&self.token))
            .finish()
    }
}

/// A short name for a key (the first 4 bytes of its SHA-256), safe to print.
pub fn key_id(k: &[u8; 32]) -> String {
    hex(&ring::digest::digest(&ring::digest::SHA256, k).as_ref()[..4])
}

pub(crate) fn hex(b: &[u8]) -> String {
    b.iter().map(|b| format!("{b:02x}")).collect()
}

fn parse_hex32(s: &[u8]) -> Option<[u8; 32]> {
    if s.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (o, pair) in out.iter_mut().zip(s.chunks(2)) {
        let digit = |c: u8| (c as char).to_digit(16);
        *o = (digit(pair[0])? * 16 + digit(pair[1])?) as u8;
    }
    Some(out)
}

fn random_key() -> Result<[u8; 32], FleetError> {
    let mut k = [0u8; 32];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut k)
        .map_err(|_| FleetError::Config("no system randomness".into()))?;
    Ok(k)
}

/// Sets `name` to `value` unless it is set, and returns what it holds.
async fn set_or_get(
    c: &mut redis::aio::MultiplexedConnection,
    name: &str,
    value: &[u8; 32],
) -> Result<[u8; 32], FleetError> {
    let (_, stored): (Option<String>, Vec<u8>) = redis::pipe()
        .cmd("SET")
        .arg(name)
        .arg(hex(value))
        .arg("NX")
        .cmd("GET")
        .arg(name)
        .query_async(c)
        .await?;
    parse_hex32(&stored).ok_or(FleetError::Corrupt("key (not 64 hex digits)"))
}

/// The keys in Redis, set by whichever server comes first; within 5 s.
pub(crate) async fn shared_keys(link: &Link) -> Result<SharedKeys, FleetError> {
    let fetch = async {
        let mut c = link.conn().await?;
        let reset = set_or_get(&mut c, RESET_KEY, &random_key()?).await?;
        let token = set_or_get(&mut c, TOKEN_KEY, &random_key()?).await?;
        Ok(SharedKeys { reset, token })
    };
    let r = tokio::time::timeout(Duration::from_secs(5), fetch)
        .await
        .unwrap_or(Err(FleetError::Timeout));
    match &r {
        Ok(_) => link.succeeded(),
        Err(e) => link.failed(e),
    }
    r
}

/// Puts the keys this server holds back into a Redis that lost them (`SET NX`: every server
/// holds the same ones); warns if Redis holds others (a server started meanwhile against
/// the empty Redis and made new ones).
pub(crate) async fn put_back(
    c: &mut redis::aio::MultiplexedConnection,
    k: &SharedKeys,
) -> Result<(), FleetError> {
    for (name, value) in [(RESET_KEY, &k.reset), (TOKEN_KEY, &k.token)] {
        let stored = set_or_get(c, name, value).await?;
        if &stored != value {
            tracing::warn!(target: "kuai::fleet", key = name,
                "redis holds another key than this server: restart this server to share it");
        }
    }
    Ok(())
}
