//! `kuai server --redis URL`: secrets every server of a fleet shares, kept in Redis — the
//! stateless-reset key (any server can reset a connection another held, RFC 9000 §10.3.2)
//! and the Retry / NEW_TOKEN token key (a token one server issued validates at another).
//!
//! The first server to start sets each key (`SET key value NX`, a random value); the others
//! read it. Nothing waits on Redis after start: the keys are read once, and a server that
//! cannot reach Redis serves with keys of its own and says so. kuai writes no key to disk
//! (Redis may, if its operator configures persistence). Session tickets are not shared yet
//! (issue 20; see docs/fleet.md).

use std::time::Duration;

use redis::AsyncCommands;

/// Redis key names.
const RESET_KEY: &str = "kuai:keys:stateless-reset";
const TOKEN_KEY: &str = "kuai:keys:address-token";

/// The fleet's secrets.
pub struct SharedKeys {
    pub reset: [u8; 32],
    pub token: [u8; 32],
}

/// A short name for a key (the first 4 bytes of its SHA-256), safe to print.
pub fn key_id(k: &[u8; 32]) -> String {
    ring::digest::digest(&ring::digest::SHA256, k).as_ref()[..4]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The shared keys from the Redis at `url` (`redis://[:password@]host:port[/db]`; the
/// client's TLS feature is not built in yet), set by whichever server comes first; within
/// 5 s.
pub async fn shared_keys(url: &str) -> Result<SharedKeys, String> {
    let fetch = async {
        let client = redis::Client::open(url).map_err(|e| e.to_string())?;
        let mut conn = client
            .get_multiplexed_async_connection()
            .await
            .map_err(|e| e.to_string())?;
        let mut get = async |name: &str| -> Result<[u8; 32], String> {
            let mut fresh = [0u8; 32];
            ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut fresh)
                .map_err(|_| "no randomness".to_string())?;
            let hex: String = fresh.iter().map(|b| format!("{b:02x}")).collect();
            let _: Option<String> = redis::cmd("SET")
                .arg(name)
                .arg(&hex)
                .arg("NX")
                .query_async(&mut conn)
                .await
                .map_err(|e| e.to_string())?;
            let stored: String = conn.get(name).await.map_err(|e| e.to_string())?;
            crate::lb::parse_hex(&stored)
                .and_then(|v| <[u8; 32]>::try_from(v).ok())
                .ok_or_else(|| format!("{name} in Redis is not 64 hex digits"))
        };
        let reset = get(RESET_KEY).await?;
        let token = get(TOKEN_KEY).await?;
        Ok(SharedKeys { reset, token })
    };
    tokio::time::timeout(Duration::from_secs(5), fetch)
        .await
        .map_err(|_| "no answer within 5 s".to_string())?
}
