//! Reading a file an operator names (a certificate, a key, a CRL, a policy, a configuration
//! file): at most a bound's worth, so that a path to a device (`/dev/zero`) or a runaway file
//! is an error naming it instead of a process that reads until memory runs out.

use std::io::Read;
use std::path::Path;

/// Most bytes read of a PEM file of certificates or of a key: a system CA bundle is about
/// 200 KiB.
pub const MAX_PEM_BYTES: u64 = 4 << 20;
/// Most bytes read of a CRL file: a large CA's CRL runs to tens of megabytes.
pub const MAX_CRL_BYTES: u64 = 256 << 20;
/// Most bytes read of a configuration, policy or labels file, or a state file of the
/// coordinator's own.
pub const MAX_SETTINGS_BYTES: u64 = 64 << 20;

/// At most `max` bytes of `input`: `None` when it holds more (it is read up to `max + 1`, so an
/// endless input ends there). Every bounded read of a file, a pipe or stdin goes through here,
/// each caller saying in its own words that the input was too large.
pub fn read_up_to(input: impl Read, max: u64) -> std::io::Result<Option<Vec<u8>>> {
    let mut bytes = Vec::new();
    input.take(max.saturating_add(1)).read_to_end(&mut bytes)?;
    Ok((bytes.len() as u64 <= max).then_some(bytes))
}

/// [`read_up_to`], as UTF-8 text (invalid UTF-8 is an error, as `read_to_string` makes it).
pub fn read_text_up_to(input: impl Read, max: u64) -> std::io::Result<Option<String>> {
    read_up_to(input, max)?
        .map(|bytes| {
            String::from_utf8(bytes).map_err(|_| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    "stream did not contain valid UTF-8",
                )
            })
        })
        .transpose()
}

/// The bytes of `path`, or an error when it holds more than `max`.
pub fn read_bounded(path: &Path, max: u64) -> std::io::Result<Vec<u8>> {
    read_up_to(std::fs::File::open(path)?, max)?.ok_or_else(|| too_large(max))
}

/// [`read_bounded`], as UTF-8 text.
pub fn read_text_bounded(path: &Path, max: u64) -> std::io::Result<String> {
    read_text_up_to(std::fs::File::open(path)?, max)?.ok_or_else(|| too_large(max))
}

/// The text of the private key file `path`, refused when every user of the machine may read
/// or write it: whoever can read a key acts as its certificate's holder (an agent, the
/// coordinator, an administrator, or a CA that signs anyone in), as `ssh` refuses such a key.
/// Its group may read it (the deployments give a service's group the key, mode 0440 or 0640);
/// only a regular file's mode counts (a pipe, `/dev/stdin`, has none to speak of), and only
/// when it holds a private key (a certificate given as the key is left to the caller's parser
/// to explain). The mode is that of the file opened, so a rename in between changes nothing.
pub fn read_private_key(path: &Path) -> Result<String, crate::TlsError> {
    use std::os::unix::fs::MetadataExt;
    let cannot_read = |e| crate::TlsError::io("cannot read", path, e);
    let file = std::fs::File::open(path).map_err(cannot_read)?;
    let md = file.metadata().map_err(cannot_read)?;
    let text = read_text_up_to(file, MAX_PEM_BYTES)
        .map_err(cannot_read)?
        .ok_or_else(|| cannot_read(too_large(MAX_PEM_BYTES)))?;
    if text.contains("PRIVATE KEY-----")
        && let Some(why) = open_to_others(md.is_file(), md.mode())
    {
        return Err(crate::TlsError::bad_file(
            path,
            format!(
                "{why}: anyone logged in here could use this private key to act as its \
                 certificate's holder, so it is not used: chmod o-rw {} (in a Kubernetes Secret \
                 volume, give it defaultMode 0400, or 0440 with the pod's fsGroup)",
                path.display()
            ),
        ));
    }
    Ok(text)
}

/// What makes a file of `mode` open to every user of the machine, if anything.
fn open_to_others(regular: bool, mode: u32) -> Option<String> {
    let what = match (mode & 0o004 != 0, mode & 0o002 != 0) {
        _ if !regular => return None,
        (true, true) => "readable and writable",
        (true, false) => "readable",
        (false, true) => "writable",
        (false, false) => return None,
    };
    Some(format!(
        "{what} by every user of this machine (mode {:04o})",
        mode & 0o7777
    ))
}

fn too_large(max: u64) -> std::io::Error {
    std::io::Error::other(format!(
        "larger than {max} bytes, the most read of such a file"
    ))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_device_or_a_file_past_the_bound_is_an_error_and_one_at_it_is_read() {
        let err = read_bounded(Path::new("/dev/zero"), 1024).unwrap_err();
        assert!(err.to_string().contains("larger than 1024 bytes"), "{err}");
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, "x".repeat(1024)).unwrap();
        assert_eq!(read_text_bounded(&path, 1024).unwrap().len(), 1024);
        assert!(read_bounded(&path, 1023).is_err());
        std::fs::write(&path, [0xff, 0xfe]).unwrap();
        assert!(read_text_bounded(&path, 1024).is_err());
        assert!(read_bounded(&dir.path().join("missing"), 1).is_err());
    }

    #[test]
    fn a_private_key_every_user_may_read_or_write_is_refused_naming_the_fix() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("key.pem");
        std::fs::write(&path, "-----BEGIN PRIVATE KEY-----\n").unwrap();
        for (mode, what) in [
            (0o644, "readable by every user of this machine (mode 0644)"),
            (0o604, "readable by every user of this machine (mode 0604)"),
            (0o602, "writable by every user of this machine (mode 0602)"),
            (
                0o666,
                "readable and writable by every user of this machine (mode 0666)",
            ),
        ] {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
            let err = read_private_key(&path).unwrap_err().to_string();
            assert!(
                err.starts_with(&format!("{}: {what}", path.display())),
                "{err}"
            );
            assert!(
                err.contains(&format!("chmod o-rw {}", path.display())),
                "{err}"
            );
        }
        // Its owner and its group may read it.
        for mode in [0o400, 0o600, 0o640, 0o440, 0o660] {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
            assert_eq!(
                read_private_key(&path).unwrap(),
                "-----BEGIN PRIVATE KEY-----\n"
            );
        }
        // A file with no key in it (a certificate given as the key) is left to the parser.
        std::fs::write(&path, "-----BEGIN CERTIFICATE-----\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(read_private_key(&path).is_ok());
        // A pipe's mode says nothing about who holds the key.
        assert_eq!(open_to_others(false, 0o666), None);
        let err = read_private_key(&dir.path().join("missing")).unwrap_err();
        assert!(err.to_string().starts_with("cannot read"), "{err}");
    }
}
