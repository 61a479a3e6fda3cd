//! Transport parameter decoding and re-encoding (`kuai_proto::transport_params`).
//!
//! The input is decoded as sent by a client and as sent by a server. Whatever decodes is
//! re-encoded (which appends one random reserved "grease" parameter, RFC 9000 §18.1) and decoded
//! again as the same side; the result must equal the first decode. The comparison is of decoded
//! structs, never bytes: the encoder drops unknown parameters and values equal to their defaults,
//! uses minimal varints and adds the grease parameter.

#![no_main]

use kuai_proto::Side;
use kuai_proto::transport_params::TransportParameters;
use libfuzzer_sys::fuzz_target;

/// The encoding travels in a TLS extension whose length field is 16 bits.
const MAX_ENCODED_LEN: usize = u16::MAX as usize;

fuzz_target!(|data: &[u8]| {
    let as_client = TransportParameters::decode(Side::Client, data);
    let as_server = TransportParameters::decode(Side::Server, data);

    // Anything a client may send, a server may send too, with the same meaning.
    if let Ok(c) = &as_client {
        match &as_server {
            Ok(s) => assert_eq!(c, s, "client and server decodes differ"),
            Err(e) => panic!("accepted from a client but not from a server: {e:?}"),
        }
    }

    for (side, decoded) in [(Side::Client, as_client), (Side::Server, as_server)] {
        let params = match decoded {
            Ok(p) => p,
            Err(e) => {
                let _ = format!("{e:?}");
                continue;
            }
        };
        let _ = format!("{params:?}");
        let _ = (
            params.max_idle_timeout_duration(),
            params.max_ack_delay_duration(),
            params.min_ack_delay_duration(),
        );

        let mut buf = Vec::new();
        params.encode(&mut buf);
        if buf.len() > MAX_ENCODED_LEN {
            // Only reachable with an input close to the limit: the grease parameter pushed the
            // re-encoding past what decode accepts.
            assert!(
                data.len() + 32 > MAX_ENCODED_LEN,
                "encoding grew to {}",
                buf.len()
            );
            continue;
        }
        let again = TransportParameters::decode(side, &buf).unwrap_or_else(|e| {
            panic!("re-encoding of {params:?} ({buf:02x?}) does not decode as {side:?}: {e:?}")
        });
        assert_eq!(
            params, again,
            "round trip as {side:?} changed the parameters"
        );

        // The 0-RTT helpers on decoded values.
        let remembered = params.remembered_for_0rtt();
        assert!(params.validate_for_0rtt(&remembered));
        let mut buf = Vec::new();
        remembered.encode(&mut buf);
        let decoded = TransportParameters::decode(Side::Server, &buf)
            .unwrap_or_else(|e| panic!("remembered {remembered:?} does not round-trip: {e:?}"));
        assert_eq!(remembered, decoded);
    }
});
