//! Certificates for the command line: load PEM files or make a self-signed certificate, and
//! the SPKI hash Chromium needs to trust it.

use std::path::Path;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

/// A certificate chain and its key.
pub struct Identity {
    pub certs: Vec<CertificateDer<'static>>,
    pub key: PrivateKeyDer<'static>,
    /// Made at start (not loaded from files).
    pub self_signed: bool,
}

impl Identity {
    pub fn load(cert: &Path, key: &Path) -> Result<Self, String> {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
            .map_err(|e| format!("cannot read certificate {}: {e}", cert.display()))?
            .collect::<Result<_, _>>()
            .map_err(|e| format!("bad certificate {}: {e}", cert.display()))?;
        if certs.is_empty() {
            return Err(format!("no certificate in {}", cert.display()));
        }
        let key = PrivateKeyDer::from_pem_file(key)
            .map_err(|e| format!("cannot read private key {}: {e}", key.display()))?;
        Ok(Self {
            certs,
            key,
            self_signed: false,
        })
    }

    pub fn self_signed(names: &[&str]) -> Result<Self, String> {
        let ck = rcgen::generate_simple_self_signed(
            names.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
        )
        .map_err(|e| format!("cannot make a certificate: {e}"))?;
        Ok(Self {
            certs: vec![ck.cert.der().clone()],
            key: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(ck.key_pair.serialize_der())),
            self_signed: true,
        })
    }

    /// Base64 of the SHA-256 of the leaf's SubjectPublicKeyInfo, as Chromium's
    /// `--ignore-certificate-errors-spki-list` takes it.
    pub fn spki_sha256(&self) -> Option<String> {
        let spki = spki_of(&self.certs[0])?;
        Some(base64(
            ring::digest::digest(&ring::digest::SHA256, spki).as_ref(),
        ))
    }
}

/// One DER element: (tag, contents, rest).
fn der(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n]
            .iter()
            .fold(0usize, |acc, &b| (acc << 8) | usize::from(b));
        (len, &rest[n..])
    };
    if rest.len() < len {
        return None;
    }
    Some((tag, &rest[..len], &rest[len..]))
}

/// The full DER of the SubjectPublicKeyInfo of an X.509 certificate (RFC 5280 §4.1).
fn spki_of(cert: &[u8]) -> Option<&[u8]> {
    let (_, certificate, _) = der(cert)?;
    let (_, tbs, _) = der(certificate)?;
    let mut rest = tbs;
    // [0] version is optional.
    if rest.first() == Some(&0xa0) {
        rest = der(rest)?.2;
    }
    // serialNumber, signature, issuer, validity, subject.
    for _ in 0..5 {
        rest = der(rest)?.2;
    }
    let (tag, contents, after) = der(rest)?;
    if tag != 0x30 {
        return None;
    }
    let whole_len = rest.len() - after.len();
    let _ = contents;
    Some(&rest[..whole_len])
}

fn base64(data: &[u8]) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(T[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_rfc4648_vectors() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(base64(b"foobar"), "Zm9vYmFy");
    }

    #[test]
    fn spki_matches_rcgen_public_key() {
        let ck = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        let spki = spki_of(ck.cert.der()).unwrap();
        assert_eq!(spki, ck.key_pair.public_key_der().as_slice());
    }
}
