//! A hostile client: a real handshake in lock step, after which the test holds the client's
//! 1-RTT keys (from its TLS key log) and sends the server any packet it likes, from any address,
//! while every byte the server sends is counted per destination.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use kuai_proto::config::TransportConfig;
use kuai_proto::crypto::{CapturedSecrets, OneRttKeys, SuiteAlgs};
use kuai_proto::packet::{self, PartialDecode};
use kuai_proto::{ConnectionHandle, ConnectionId, Endpoint, Event};

/// Length of the connection IDs the server issues (kuai's default generator).
const CID_LEN: usize = 8;

/// The TLS secrets a client logged, by label (SSLKEYLOGFILE labels), latest handshake.
#[derive(Debug, Default)]
pub struct KeyLogSecrets(Mutex<HashMap<String, Vec<u8>>>);

impl KeyLogSecrets {
    /// The secret of `label`, empty if none was logged.
    pub fn get(&self, label: &str) -> Vec<u8> {
        self.0
            .lock()
            .unwrap()
            .get(label)
            .cloned()
            .unwrap_or_default()
    }
}

impl rustls::KeyLog for KeyLogSecrets {
    fn log(&self, label: &str, _client_random: &[u8], secret: &[u8]) {
        self.0
            .lock()
            .unwrap()
            .insert(label.to_owned(), secret.to_vec());
    }

    fn will_log(&self, _label: &str) -> bool {
        true
    }
}

/// A client TLS configuration that offers one cipher suite, AES-128-GCM, so a test knows
/// which packet keys to derive from the secrets it logs.
pub fn aes128_client_tls(certs: &super::Certs) -> rustls::ClientConfig {
    let provider = rustls::crypto::CryptoProvider {
        cipher_suites: vec![rustls::crypto::ring::cipher_suite::TLS13_AES_128_GCM_SHA256],
        ..rustls::crypto::ring::default_provider()
    };
    let mut roots = rustls::RootCertStore::empty();
    roots.add(certs.cert.clone()).unwrap();
    let mut tls = rustls::ClientConfig::builder_with_provider(Arc::new(provider))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    tls.alpn_protocols = vec![super::ALPN.to_vec()];
    tls
}

pub const SERVER: &str = "127.0.0.1:4433";
pub const CLIENT: &str = "127.0.0.1:5000";

/// The server endpoint and a client whose 1-RTT packets the test writes itself.
pub struct Hostile {
    pub now: Instant,
    pub server: Endpoint,
    pub client: Endpoint,
    pub client_handle: ConnectionHandle,
    pub server_handle: Option<ConnectionHandle>,
    pub saddr: SocketAddr,
    pub caddr: SocketAddr,
    keys: Option<OneRttKeys>,
    dcid: ConnectionId,
    next_pn: u64,
    /// Bytes the server sent to each address, and received from each address.
    pub sent_to: HashMap<SocketAddr, u64>,
    pub received_from: HashMap<SocketAddr, u64>,
    /// Packet numbers of the server's 1-RTT packets, in the order they were sent.
    pub server_pns: Vec<u64>,
    buf: Vec<u8>,
}

impl Hostile {
    /// Connects with these transport configs; the handshake is confirmed on both sides and
    /// from here on only the test speaks for the client.
    pub fn connect(stransport: TransportConfig, ctransport: TransportConfig) -> Self {
        let certs = super::certs();
        let now = Instant::now();
        let saddr: SocketAddr = SERVER.parse().unwrap();
        let caddr: SocketAddr = CLIENT.parse().unwrap();
        let scfg = Arc::new(super::server_config(&certs, stransport));
        let mut tls = aes128_client_tls(&certs);
        let secrets = Arc::new(KeyLogSecrets::default());
        tls.key_log = secrets.clone();
        let mut ccfg = kuai_proto::ClientConfig::new(Arc::new(tls));
        ccfg.transport = Arc::new(ctransport);
        let server = Endpoint::new(super::endpoint_config(), Some(scfg), now, 0, Some(1));
        let mut client = Endpoint::new(super::endpoint_config(), None, now, 0, Some(2));
        let ch = client.connect(now, &ccfg, saddr, "localhost").unwrap();
        let mut h = Hostile {
            now,
            server,
            client,
            client_handle: ch,
            server_handle: None,
            saddr,
            caddr,
            keys: None,
            dcid: ConnectionId::EMPTY,
            next_pn: 0,
            sent_to: HashMap::new(),
            received_from: HashMap::new(),
            server_pns: Vec::new(),
            buf: Vec::new(),
        };
        let mut confirmed = false;
        for _ in 0..200 {
            let n = h.exchange();
            if let Some(sh) = h.server.accept() {
                h.server_handle = Some(sh);
            }
            while let Some((_, e)) = h.client.poll_event() {
                if e == Event::HandshakeConfirmed {
                    confirmed = true;
                }
            }
            if confirmed && n == 0 {
                break;
            }
            if n == 0 {
                h.advance(Duration::from_millis(1));
            }
        }
        assert!(confirmed, "the handshake did not complete");
        let secrets = CapturedSecrets {
            client_traffic: secrets.get("CLIENT_TRAFFIC_SECRET_0"),
            server_traffic: secrets.get("SERVER_TRAFFIC_SECRET_0"),
            ..Default::default()
        };
        let algs = SuiteAlgs::of(rustls::CipherSuite::TLS13_AES_128_GCM_SHA256).unwrap();
        h.keys = OneRttKeys::derived(algs, kuai_proto::Version::V1, &secrets);
        assert!(h.keys.is_some(), "no 1-RTT secrets in the key log");
        // The client's own packets tell which server CID it uses; forged packet numbers start
        // well above anything it sent.
        let c = h.client.connection_mut(ch).unwrap();
        c.send_datagram(bytes::Bytes::from_static(b"x")).unwrap();
        let mut buf = Vec::new();
        let t = h
            .client
            .poll_transmit(h.now, 1, &mut buf)
            .expect("a client packet");
        let (pd, _) = PartialDecode::new(BytesMut::from(&buf[..t.size]), CID_LEN).unwrap();
        h.dcid = pd.dst_cid();
        h.next_pn = 10_000;
        h.sent_to.clear();
        h.received_from.clear();
        h.server_pns.clear();
        h
    }

    /// One round of honest traffic both ways (before the test takes over); datagrams moved.
    fn exchange(&mut self) -> usize {
        let mut n = 0;
        while let Some(t) = self.client.poll_transmit(self.now, 1, &mut self.buf) {
            let d = BytesMut::from(&self.buf[..t.size]);
            self.server
                .handle_datagram(self.now, self.caddr, None, t.ecn, d);
            n += 1;
        }
        while let Some(t) = self.server.poll_transmit(self.now, 1, &mut self.buf) {
            let d = BytesMut::from(&self.buf[..t.size]);
            self.client
                .handle_datagram(self.now, self.saddr, None, t.ecn, d);
            n += 1;
        }
        n
    }

    /// Moves the clock on and runs both endpoints' timers.
    pub fn advance(&mut self, by: Duration) {
        self.now += by;
        self.server.handle_timeout(self.now);
        self.client.handle_timeout(self.now);
    }

    /// A 1-RTT packet from the client with these frames (padded for the header-protection
    /// sample only), with the next forged packet number.
    pub fn packet(&mut self, frames: &[u8]) -> Vec<u8> {
        let pn = self.next_pn;
        self.next_pn += 1;
        let mut buf = Vec::with_capacity(frames.len() + 64);
        let keys = self.keys.as_ref().expect("set after the handshake");
        let pos = packet::write_short_header(&mut buf, &self.dcid, false, keys.phase, pn, 4);
        buf.extend_from_slice(frames);
        while buf.len() < pos.payload_offset() + 4 {
            buf.push(0);
        }
        packet::seal_packet(
            &mut buf,
            &pos,
            pn,
            keys.header.local.as_ref(),
            keys.current.local.as_ref(),
        )
        .unwrap();
        buf
    }

    /// Skips `n` packet numbers (the server then sees the next packet out of order).
    pub fn skip_pns(&mut self, n: u64) {
        self.next_pn += n;
    }

    /// Hands a datagram to the server as if it came from `from`.
    pub fn inject(&mut self, from: SocketAddr, datagram: &[u8]) {
        *self.received_from.entry(from).or_default() += datagram.len() as u64;
        self.server
            .handle_datagram(self.now, from, None, None, BytesMut::from(datagram));
    }

    /// Everything the server sends now, counted per destination (and returned); the packet
    /// numbers of its 1-RTT packets are noted in `server_pns`.
    pub fn drain_server(&mut self) -> Vec<(SocketAddr, Vec<u8>)> {
        let mut out = Vec::new();
        for _ in 0..100_000 {
            let Some(t) = self.server.poll_transmit(self.now, 1, &mut self.buf) else {
                return out;
            };
            *self.sent_to.entry(t.destination).or_default() += t.size as u64;
            let d = self.buf[..t.size].to_vec();
            if let Some(keys) = self.keys.as_ref()
                && d[0] & 0x80 == 0
                && let Ok((pd, _)) = PartialDecode::new(BytesMut::from(&d[..]), CID_LEN)
                && let Ok(up) =
                    pd.unprotect(keys.header.remote.as_ref(), self.server_pns.last().copied())
            {
                self.server_pns.push(up.pn());
            }
            out.push((t.destination, d));
        }
        panic!("the server never stops sending");
    }

    /// The frames of a 1-RTT datagram the server sent (empty if it does not open).
    pub fn server_frames(&self, datagram: &[u8]) -> Vec<kuai_proto::frame::Frame> {
        let Some(keys) = self.keys.as_ref() else {
            return Vec::new();
        };
        let Ok((pd, _)) = PartialDecode::new(BytesMut::from(datagram), CID_LEN) else {
            return Vec::new();
        };
        let Ok(up) = pd.unprotect(keys.header.remote.as_ref(), self.server_pns.last().copied())
        else {
            return Vec::new();
        };
        let Ok(p) = up.decrypt(keys.current.remote.as_ref()) else {
            return Vec::new();
        };
        kuai_proto::frame::FrameIter::new(p.payload)
            .filter_map(Result::ok)
            .collect()
    }

    pub fn server_conn(&mut self) -> &mut kuai_proto::Connection {
        let h = self.server_handle.expect("accepted");
        self.server.connection_mut(h).unwrap()
    }
}

/// A STREAM frame with an explicit offset and length (RFC 9000 §19.8).
pub fn stream_frame(id: u64, offset: u64, data: &[u8], fin: bool) -> Vec<u8> {
    use kuai_proto::VarInt;
    let mut f = vec![0x08 | 0x04 | 0x02 | u8::from(fin)];
    VarInt::saturating(id).encode(&mut f);
    VarInt::saturating(offset).encode(&mut f);
    VarInt::saturating(data.len() as u64).encode(&mut f);
    f.extend_from_slice(data);
    f
}

/// An ACK frame (RFC 9000 §19.3) for these ranges, given largest first, with no delay.
pub fn ack_frame(ranges: &[std::ops::RangeInclusive<u64>]) -> Vec<u8> {
    use kuai_proto::VarInt;
    let mut f = vec![0x02];
    let first = &ranges[0];
    VarInt::saturating(*first.end()).encode(&mut f);
    VarInt::saturating(0).encode(&mut f);
    VarInt::saturating(ranges.len() as u64 - 1).encode(&mut f);
    VarInt::saturating(first.end() - first.start()).encode(&mut f);
    let mut prev_start = *first.start();
    for r in &ranges[1..] {
        VarInt::saturating(prev_start - r.end() - 2).encode(&mut f);
        VarInt::saturating(r.end() - r.start()).encode(&mut f);
        prev_start = *r.start();
    }
    f
}

/// `pns` (ascending) as ranges, largest first.
pub fn ranges_of(pns: &[u64]) -> Vec<std::ops::RangeInclusive<u64>> {
    let mut out: Vec<std::ops::RangeInclusive<u64>> = Vec::new();
    for &pn in pns {
        match out.last_mut() {
            Some(r) if *r.end() + 1 == pn => *r = *r.start()..=pn,
            _ => out.push(pn..=pn),
        }
    }
    out.reverse();
    out
}
