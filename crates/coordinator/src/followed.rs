//! A settings file the coordinator follows while it runs (`--policy`, `--host-labels`): read at
//! start, where a file that cannot be used stops the coordinator, then looked at every
//! [`LOOK_EVERY`] and on `SIGHUP`, and read again when it changed (another inode, size,
//! modification or change time: an edit, a file put in its place, a Kubernetes ConfigMap's
//! link swapped, a `chmod`). A file that no longer loads (broken JSON, an unknown key, a mode every user may write, gone) leaves
//! the settings in force as they were, and says so once per change of the file. Once running,
//! only a regular file is read: opening a FIFO put in its place would block the runtime's
//! thread until someone writes to it.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use crate::error::FileError;

/// How often the file is looked at.
pub const LOOK_EVERY: Duration = Duration::from_secs(2);

/// The file's identity and times, as last looked at: a change of any is read again.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Stamp {
    File {
        regular: bool,
        dev: u64,
        ino: u64,
        size: u64,
        mtime: (i64, i64),
        ctime: (i64, i64),
    },
    /// It could not be looked at (gone, or a directory on its way cannot be searched).
    Missing(std::io::ErrorKind),
}

impl Stamp {
    fn of(path: &Path) -> Self {
        match std::fs::metadata(path) {
            Ok(m) => Stamp::File {
                regular: m.is_file(),
                dev: m.dev(),
                ino: m.ino(),
                size: m.size(),
                mtime: (m.mtime(), m.mtime_nsec()),
                ctime: (m.ctime(), m.ctime_nsec()),
            },
            Err(e) => Stamp::Missing(e.kind()),
        }
    }
}

/// What looking at the file again found.
#[derive(Debug)]
pub enum Looked {
    /// Nothing changed, or there is no file.
    Same,
    /// The file changed and its new settings are in force.
    Loaded,
    /// The file changed and cannot be used: the settings in force stay.
    Refused(FileError),
}

/// Settings of type `T`, following their file when there is one.
#[derive(Debug)]
pub struct Followed<T> {
    /// What the file is, for messages (`policy`).
    what: &'static str,
    path: Option<PathBuf>,
    load: fn(&Path) -> Result<T, FileError>,
    now: RwLock<Arc<T>>,
    stamp: Mutex<Option<Stamp>>,
    /// Whether the file as it is now was refused (what is in force is an older one).
    refused: AtomicBool,
}

impl<T: Default> Followed<T> {
    /// The settings in `path` (`T::default()` without one), read with `load`; `what` names
    /// the file in messages.
    pub fn open(
        what: &'static str,
        path: Option<&Path>,
        load: fn(&Path) -> Result<T, FileError>,
    ) -> Result<Self, FileError> {
        let stamp = path.map(Stamp::of);
        let settings = match path {
            Some(path) => load(path)?,
            None => T::default(),
        };
        Ok(Self {
            what,
            path: path.map(Path::to_path_buf),
            load,
            now: RwLock::new(Arc::new(settings)),
            stamp: Mutex::new(stamp),
            refused: AtomicBool::new(false),
        })
    }

    /// The settings in force.
    pub fn now(&self) -> Arc<T> {
        self.now.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Whether the file changed since what is in force was read, and cannot be used.
    pub fn refused(&self) -> bool {
        self.refused.load(Ordering::Relaxed)
    }

    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// Reads the file again if it changed since it was last looked at.
    pub fn look(&self) -> Looked {
        let Some(path) = &self.path else {
            return Looked::Same;
        };
        let stamp = Stamp::of(path);
        {
            let mut last = self.stamp.lock().unwrap_or_else(|p| p.into_inner());
            if last.as_ref() == Some(&stamp) {
                return Looked::Same;
            }
            // Taken before the read: a write during it changes the stamp again, and the next
            // look reads the file once more.
            *last = Some(stamp.clone());
        }
        if let Stamp::File { regular: false, .. } = stamp {
            self.refused.store(true, Ordering::Relaxed);
            return Looked::Refused(FileError::invalid(
                self.what,
                path,
                "not a regular file (a pipe or a device, put in its place): the running \
                 coordinator reads only a regular file"
                    .to_string(),
            ));
        }
        match (self.load)(path) {
            Ok(settings) => {
                *self.now.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(settings);
                self.refused.store(false, Ordering::Relaxed);
                Looked::Loaded
            }
            Err(e) => {
                self.refused.store(true, Ordering::Relaxed);
                Looked::Refused(e)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn load(path: &Path) -> Result<String, FileError> {
        let text = std::fs::read_to_string(path).map_err(|e| FileError::read("test", path, e))?;
        if text.starts_with("bad") {
            return Err(FileError::invalid("test", path, "bad".to_string()));
        }
        Ok(text)
    }

    #[test]
    fn a_change_is_read_again_and_a_broken_file_leaves_the_settings_in_force() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("settings");
        std::fs::write(&path, "one").unwrap();
        let followed = Followed::open("test", Some(&path), load).unwrap();
        assert_eq!(*followed.now(), "one");
        assert!(matches!(followed.look(), Looked::Same));

        std::fs::write(&path, "two, longer").unwrap();
        assert!(matches!(followed.look(), Looked::Loaded));
        assert_eq!(*followed.now(), "two, longer");

        // Broken: refused once, the settings in force stay, and the same file is not read again.
        std::fs::write(&path, "bad!").unwrap();
        assert!(matches!(followed.look(), Looked::Refused(_)));
        assert!(matches!(followed.look(), Looked::Same));
        assert_eq!(*followed.now(), "two, longer");
        assert!(followed.refused());

        // Gone: refused once; back, read again.
        std::fs::remove_file(&path).unwrap();
        assert!(matches!(followed.look(), Looked::Refused(_)));
        assert!(matches!(followed.look(), Looked::Same));
        std::fs::write(&path, "three").unwrap();
        assert!(matches!(followed.look(), Looked::Loaded));
        assert_eq!(*followed.now(), "three");
        assert!(!followed.refused());

        // Another file put in its place, as an editor saving by rename does: another inode.
        let other = dir.path().join("other");
        std::fs::write(&other, "four!").unwrap();
        std::fs::rename(&other, &path).unwrap();
        assert!(matches!(followed.look(), Looked::Loaded));
        assert_eq!(*followed.now(), "four!");

        // A file that does not load at start stops the start; no file: the default, for good.
        std::fs::write(&path, "bad").unwrap();
        // A FIFO put in its place is not opened (that would wait for a writer).
        std::fs::remove_file(&path).unwrap();
        nix::unistd::mkfifo(&path, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let followed = Arc::new(followed);
        let (tx, rx) = std::sync::mpsc::channel();
        let looking = followed.clone();
        std::thread::spawn(move || tx.send(looking.look()).unwrap());
        match rx.recv_timeout(Duration::from_secs(5)) {
            Ok(Looked::Refused(e)) => assert!(e.to_string().contains("not a regular file"), "{e}"),
            Ok(other) => panic!("{other:?}"),
            Err(_) => {
                // Let the stuck reader go before failing.
                let _ = std::fs::write(&path, "x");
                panic!("looking at a FIFO waited for a writer");
            }
        }
        assert_eq!(*followed.now(), "four!");
        std::fs::remove_file(&path).unwrap();

        std::fs::write(&path, "bad").unwrap();
        assert!(Followed::open("test", Some(&path), load).is_err());
        let none = Followed::<String>::open("test", None, load).unwrap();
        assert_eq!(*none.now(), "");
        assert!(matches!(none.look(), Looked::Same));
    }
}
