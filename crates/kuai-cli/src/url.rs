//! Just enough URL parsing for `https://host[:port]/path`.

use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Url {
    pub host: String,
    pub port: u16,
    pub path: String,
}

impl Url {
    pub fn parse(s: &str) -> Result<Self, String> {
        // RFC 3986 §2: no spaces or control characters anywhere in a URL (they would also end
        // up in an HTTP/0.9 request line).
        if s.chars()
            .any(|c| c.is_ascii_whitespace() || c.is_ascii_control())
        {
            return Err(format!("{s:?}: spaces or control characters in the URL"));
        }
        let rest = s
            .strip_prefix("https://")
            .ok_or_else(|| format!("{s}: only https:// URLs are supported"))?;
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/"),
        };
        if authority.is_empty() {
            return Err(format!("{s}: no host"));
        }
        if authority.contains('@') {
            return Err(format!(
                "{s}: credentials in the URL are not sent (use -H 'Authorization: ...')"
            ));
        }
        let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
            let end = v6
                .find(']')
                .ok_or_else(|| format!("{s}: unterminated IPv6 address"))?;
            let host = &v6[..end];
            let port = match &v6[end + 1..] {
                "" => 443,
                p => p
                    .strip_prefix(':')
                    .and_then(|p| p.parse().ok())
                    .ok_or_else(|| format!("{s}: bad port"))?,
            };
            (host.to_string(), port)
        } else {
            let (host, port) = match authority.rsplit_once(':') {
                Some((h, p)) => (
                    h.to_string(),
                    p.parse().map_err(|_| format!("{s}: bad port {p:?}"))?,
                ),
                None => (authority.to_string(), 443),
            };
            if host.contains(':') {
                return Err(format!("{s}: an IPv6 address goes in brackets"));
            }
            (host, port)
        };
        // What is written back (Display) must parse to the same URL.
        if host.is_empty() {
            return Err(format!("{s}: no host"));
        }
        if host.contains(['[', ']']) {
            return Err(format!("{s}: bad host {host:?}"));
        }
        Ok(Self {
            host,
            port,
            path: path.to_string(),
        })
    }

    /// The last path segment, for saving a download under its own name.
    pub fn file_name(&self) -> String {
        let name = self
            .path
            .split(['?', '#'])
            .next()
            .unwrap_or("")
            .rsplit('/')
            .next()
            .unwrap_or("");
        if name.is_empty() {
            "index.html".into()
        } else {
            name.into()
        }
    }
}

impl fmt::Display for Url {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "https://[{}]:{}{}", self.host, self.port, self.path)
        } else {
            write!(f, "https://{}:{}{}", self.host, self.port, self.path)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses() {
        let u = Url::parse("https://localhost:4433/a/b.bin").unwrap();
        assert_eq!(
            (u.host.as_str(), u.port, u.path.as_str()),
            ("localhost", 4433, "/a/b.bin")
        );
        assert_eq!(u.file_name(), "b.bin");
        let u = Url::parse("https://example.com").unwrap();
        assert_eq!(
            (u.port, u.path.as_str(), u.file_name().as_str()),
            (443, "/", "index.html")
        );
        let u = Url::parse("https://[::1]:8443/x").unwrap();
        assert_eq!((u.host.as_str(), u.port), ("::1", 8443));
        assert!(Url::parse("http://x/").is_err());
        assert!(Url::parse("https://x:notaport/").is_err());
        assert!(Url::parse("https:///x").is_err());
        assert!(Url::parse("https://u:pw@example.com/").is_err());
        assert!(Url::parse("https://example.com:70000/").is_err());
    }

    /// Found by the `url` fuzz target: each of these parsed, and the URL it gave was written
    /// (`Display`) as something that parsed to another URL or not at all, or had no host.
    #[test]
    fn refuses_hosts_that_do_not_round_trip() {
        for bad in [
            "https://:80/",
            "https://[]/",
            "https://[[a]:1/",
            "https://a]:b:1/",
            "https://h]/x",
            "https://a:b:1/",
            "https://h\r\n/x",
            "https://h/a b",
            "https://h/\0",
        ] {
            assert!(
                Url::parse(bad).is_err(),
                "{bad:?} parsed: {:?}",
                Url::parse(bad)
            );
        }
        for good in [
            "https://h/",
            "https://h:1/p?q#f",
            "https://[::1]/",
            "https://[fe80::1%25eth0]:8443/x",
            "https://127.0.0.1:4433/a/b",
        ] {
            let u = Url::parse(good).unwrap();
            assert_eq!(Url::parse(&u.to_string()).unwrap(), u, "{good}");
        }
    }
}
