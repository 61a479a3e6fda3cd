//! TLS key log in the NSS format (SSLKEYLOGFILE), for Wireshark and tshark.

use std::fmt::Write as _;
use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::sync::Mutex;

#[derive(Debug)]
pub struct FileKeyLog(Mutex<File>);

impl FileKeyLog {
    /// Opens `path` to append to, made readable by its owner only (it holds every
    /// connection's traffic secrets); an existing file that others can read is warned of.
    pub fn create(path: &Path) -> std::io::Result<Self> {
        let mut o = std::fs::OpenOptions::new();
        o.create(true).append(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut o, 0o600);
        let f = o.open(path)?;
        #[cfg(unix)]
        if let Ok(m) = f.metadata() {
            use std::os::unix::fs::PermissionsExt;
            if m.permissions().mode() & 0o077 != 0 {
                tracing::warn!(
                    path = %path.display(),
                    "the key log is readable by others: it decrypts every connection"
                );
            }
        }
        Ok(Self(Mutex::new(f)))
    }
}

fn hex(out: &mut String, b: &[u8]) {
    for x in b {
        let _ = write!(out, "{x:02x}");
    }
}

impl rustls::KeyLog for FileKeyLog {
    fn log(&self, label: &str, client_random: &[u8], secret: &[u8]) {
        let mut line =
            String::with_capacity(label.len() + 2 * (client_random.len() + secret.len()) + 3);
        line.push_str(label);
        line.push(' ');
        hex(&mut line, client_random);
        line.push(' ');
        hex(&mut line, secret);
        line.push('\n');
        if let Ok(mut f) = self.0.lock() {
            let _ = f.write_all(line.as_bytes());
        }
    }
}

#[cfg(all(test, unix))]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    /// The key log decrypts every connection: created readable by its owner only.
    #[test]
    fn the_key_log_is_created_private() {
        let path = std::env::temp_dir().join(format!("kuai-keylog-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let log = super::FileKeyLog::create(&path).unwrap();
        rustls::KeyLog::log(&log, "CLIENT_RANDOM", &[1; 32], &[2; 48]);
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o077, 0, "{mode:o}");
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.starts_with("CLIENT_RANDOM 0101"), "{text}");
        std::fs::remove_file(&path).unwrap();
    }
}
