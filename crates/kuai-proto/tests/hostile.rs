//! A peer that attacks: packets a real client would never send, from addresses it does not
//! own. Each test reproduces a way to make the server amplify traffic or hold memory, and
//! checks the bound that stops it.

mod support;

use std::net::SocketAddr;

use kuai_proto::config::TransportConfig;
use support::hostile::Hostile;

/// PATH_CHALLENGE frame (RFC 9000 §19.17).
fn path_challenge(data: [u8; 8]) -> Vec<u8> {
    let mut f = vec![0x1a];
    f.extend_from_slice(&data);
    f
}

/// RFC 9000 §8.2.1, §9.3: a PATH_CHALLENGE from an address that has not been validated is
/// answered within three times the bytes that came from it. A small packet of challenges
/// with a victim's source address must not turn into padded responses sent to the victim.
#[test]
fn path_challenges_from_a_spoofed_address_are_not_amplified() {
    let mut h = Hostile::connect(TransportConfig::default(), TransportConfig::default());
    let victim: SocketAddr = "192.0.2.7:443".parse().unwrap();
    for round in 0..50u8 {
        let mut frames = Vec::new();
        for i in 0..8u8 {
            frames.extend(path_challenge([round, i, 0, 0, 0, 0, 0, 0]));
        }
        let p = h.packet(&frames);
        assert!(p.len() < 120, "{} bytes", p.len());
        h.inject(victim, &p);
        h.drain_server();
        let sent = h.sent_to.get(&victim).copied().unwrap_or(0);
        let received = h.received_from[&victim];
        assert!(
            sent <= 3 * received,
            "round {round}: {sent} bytes sent to the spoofed address for {received} received"
        );
    }
    // The connection itself is unharmed: the client's own address still works.
    assert!(!h.server_conn().is_closed());
}

/// An honest probe of a new path (a padded 1,200-byte datagram) still gets a full-size
/// response: the budget is three times what arrived.
#[test]
fn a_padded_path_challenge_gets_a_padded_response() {
    let mut h = Hostile::connect(TransportConfig::default(), TransportConfig::default());
    let new_addr: SocketAddr = "127.0.0.1:5001".parse().unwrap();
    let mut frames = path_challenge([9; 8]);
    frames.resize(1200 - 1 - 8 - 4 - 16, 0);
    let p = h.packet(&frames);
    assert_eq!(p.len(), 1200);
    h.inject(new_addr, &p);
    let out = h.drain_server();
    let to_new: Vec<_> = out.iter().filter(|(a, _)| *a == new_addr).collect();
    assert_eq!(to_new.len(), 1, "one response on the new path");
    assert!(to_new[0].1.len() >= 1200, "{} bytes", to_new[0].1.len());
}

/// A non-probing packet from a new address moves the connection there (RFC 9000 §9.3); until
/// the new address answers the server's challenge it gets at most three times what came from
/// it, challenge, response and data together; an honest client's full-size datagram lets it
/// go on at once.
#[test]
fn a_migration_to_an_unvalidated_address_stays_within_3x() {
    for (name, pad) in [("spoofed", false), ("honest", true)] {
        let mut h = Hostile::connect(TransportConfig::default(), TransportConfig::default());
        // The server has data queued for the client.
        let conn = h.server_conn();
        let s = conn.open_stream(kuai_proto::Dir::Uni).unwrap();
        conn.write(s, bytes::Bytes::from(vec![7u8; 100_000]))
            .unwrap();
        let new_addr: SocketAddr = "198.51.100.9:4000".parse().unwrap();
        let mut frames = path_challenge([1; 8]);
        frames.push(0x01); // PING: not a probing frame
        if pad {
            frames.resize(1200 - 1 - 8 - 4 - 16, 0);
        }
        let p = h.packet(&frames);
        h.inject(new_addr, &p);
        for _ in 0..20 {
            h.drain_server();
            h.advance(std::time::Duration::from_millis(50));
        }
        h.drain_server();
        let sent = h.sent_to.get(&new_addr).copied().unwrap_or(0);
        let received = h.received_from[&new_addr];
        assert!(sent > 0, "{name}: nothing sent to the new address");
        assert!(
            sent <= 3 * received,
            "{name}: {sent} bytes sent to the new address for {received} received"
        );
        if pad {
            assert!(sent >= 2400, "{name}: only {sent} bytes sent");
        }
    }
}
