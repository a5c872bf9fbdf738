//! Kernel images kept on disk: what NVRTC made of one source with one option list and one
//! NVRTC version (a cubin, or PTX where NVRTC could not emit one), so a machine compiles
//! each module once rather than once per process. The whole key is stored beside the image
//! and compared on every read, and the image carries a checksum and must look like its
//! kind (an ELF cubin, PTX text without NUL), so a hash collision or a damaged file is a
//! miss, never another kernel; a file is written under a fresh temporary name and renamed
//! into place, so a reader never sees half of one. A read marks its file as used, and a
//! write removes images no process has used for [`UNUSED_DAYS`] days (those of older
//! sources and NVRTC versions), so the directory does not grow with every upgrade.

use std::ffi::OsString;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::image::ImageKind;

/// The first bytes of every cache file (and the format's version).
const MAGIC: &[u8; 8] = b"attnkc02";

/// Days after its last use when a write removes an image.
pub const UNUSED_DAYS: u64 = 30;

/// A directory of kernel images.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelCache {
    dir: PathBuf,
}

impl KernelCache {
    /// The cache in `dir` (created on the first write).
    pub fn at(dir: impl Into<PathBuf>) -> Self {
        KernelCache { dir: dir.into() }
    }

    /// The cache the environment names: `ATTN_CUDA_CACHE_DIR` (empty, `off`, `none`, `0`
    /// or `false`: none), else `$XDG_CACHE_HOME/attn/cuda-kernels`, else
    /// `$HOME/.cache/attn/cuda-kernels` (a relative `XDG_CACHE_HOME` or `HOME` is ignored,
    /// as the XDG specification says); `None` where none is named.
    pub fn from_env() -> Option<Self> {
        Self::from_vars(|name| std::env::var_os(name))
    }

    /// [`Self::from_env`] over the variables `var` gives.
    pub fn from_vars(var: impl Fn(&str) -> Option<OsString>) -> Option<Self> {
        if let Some(dir) = var("ATTN_CUDA_CACHE_DIR") {
            let off = ["", "off", "none", "0", "false"].iter().any(|w| dir.eq_ignore_ascii_case(w));
            return (!off).then(|| Self::at(dir));
        }
        let absolute = |name: &str| var(name).map(PathBuf::from).filter(|p| p.is_absolute());
        let base = absolute("XDG_CACHE_HOME").or_else(|| absolute("HOME").map(|h| h.join(".cache")));
        base.map(|b| Self::at(b.join("attn").join("cuda-kernels")))
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn file(&self, key: &[u8]) -> PathBuf {
        self.dir.join(format!("{:016x}.kernels", fnv1a(key)))
    }

    /// The image kept for `key`, if a file holds exactly this key and a whole image, in a
    /// directory other users cannot write (anyone who can write there could plant a
    /// kernel under a predictable name).
    pub fn get(&self, key: &[u8]) -> Option<(Vec<u8>, ImageKind)> {
        if writable_by_others(&self.dir) {
            return None;
        }
        let data = fs::read(self.file(key)).ok()?;
        let rest = data.strip_prefix(MAGIC.as_slice())?;
        let (stored, rest) = length_prefixed(rest)?;
        if stored != key {
            return None;
        }
        let (&kind, rest) = rest.split_first()?;
        let kind = match kind {
            0 => ImageKind::Cubin,
            1 => ImageKind::Ptx,
            _ => return None,
        };
        let (image, rest) = length_prefixed(rest)?;
        let sum = u64::from_le_bytes(*rest.first_chunk::<8>()?);
        let looks_right = match kind {
            ImageKind::Cubin => image.starts_with(b"\x7fELF"),
            ImageKind::Ptx => !image.is_empty() && !image.contains(&0),
        };
        let whole = rest.len() == 8 && sum == fnv1a(image) && looks_right;
        if whole {
            // Used now (its modification time is its last use); a failure only ages it.
            let _ = fs::File::options()
                .write(true)
                .open(self.file(key))
                .and_then(|f| f.set_modified(std::time::SystemTime::now()));
        }
        whole.then(|| (image.to_vec(), kind))
    }

    /// Keep `image` for `key`, replacing what the file held.
    pub fn put(&self, key: &[u8], image: &[u8], kind: ImageKind) -> std::io::Result<()> {
        create_private_dir(&self.dir)?;
        let file = self.file(key);
        // Unique among this process's writes; `create_new` refuses a name another process
        // (on another host sharing the directory) happens to hold.
        static WRITES: AtomicU64 = AtomicU64::new(0);
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let n = WRITES.fetch_add(1, Ordering::Relaxed);
        let tmp = self.dir.join(format!(".{:016x}.{}.{nanos}.{n}.tmp", fnv1a(key), std::process::id()));
        let write = || -> std::io::Result<()> {
            let mut f = fs::OpenOptions::new().write(true).create_new(true).open(&tmp)?;
            f.write_all(MAGIC)?;
            f.write_all(&(key.len() as u64).to_le_bytes())?;
            f.write_all(key)?;
            f.write_all(&[u8::from(kind == ImageKind::Ptx)])?;
            f.write_all(&(image.len() as u64).to_le_bytes())?;
            f.write_all(image)?;
            f.write_all(&fnv1a(image).to_le_bytes())?;
            f.sync_all()?;
            fs::rename(&tmp, &file)
        };
        write().inspect_err(|_| {
            let _ = fs::remove_file(&tmp);
        })?;
        self.remove_stale_files();
        Ok(())
    }

    /// Removes temporary files older than an hour (what a process killed mid-write left)
    /// and images unused for [`UNUSED_DAYS`] days.
    fn remove_stale_files(&self) {
        let Ok(entries) = fs::read_dir(&self.dir) else { return };
        let hour = std::time::Duration::from_secs(3600);
        let unused = std::time::Duration::from_secs(UNUSED_DAYS * 24 * 3600);
        for entry in entries.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            let age = entry.metadata().ok().and_then(|m| m.modified().ok()).and_then(|t| t.elapsed().ok());
            let temporary = name.starts_with('.') && name.ends_with(".tmp") && age.is_some_and(|a| a > hour);
            let image = !name.starts_with('.') && name.ends_with(".kernels") && age.is_some_and(|a| a > unused);
            if temporary || image {
                let _ = fs::remove_file(entry.path());
            }
        }
    }
}

/// Creates `dir` and its missing parents for the owner alone (whatever the umask), so the
/// cache it writes is one [`KernelCache::get`] reads.
#[cfg(unix)]
fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)
}

#[cfg(not(unix))]
fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    fs::create_dir_all(dir)
}

/// Whether users other than the owner and group may write `dir` (where it exists).
#[cfg(unix)]
fn writable_by_others(dir: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    fs::metadata(dir).is_ok_and(|m| m.permissions().mode() & 0o002 != 0)
}

#[cfg(not(unix))]
fn writable_by_others(_dir: &Path) -> bool {
    false
}

/// The key of one compile: NVRTC's version, the options and the source, each part
/// length-prefixed so no two different lists give the same bytes.
pub fn image_key(nvrtc: (i32, i32), options: &[String], src: &str) -> Vec<u8> {
    let version = format!("nvrtc {}.{}", nvrtc.0, nvrtc.1);
    let parts = std::iter::once(version.as_str()).chain(options.iter().map(String::as_str)).chain([src]);
    let mut key = Vec::with_capacity(src.len() + 256);
    for p in parts {
        key.extend_from_slice(&(p.len() as u64).to_le_bytes());
        key.extend_from_slice(p.as_bytes());
    }
    key
}

/// `(bytes, rest)` of a little-endian u64 length followed by that many bytes.
fn length_prefixed(data: &[u8]) -> Option<(&[u8], &[u8])> {
    let (len, rest) = data.split_first_chunk::<8>()?;
    let len = usize::try_from(u64::from_le_bytes(*len)).ok()?;
    (rest.len() >= len).then(|| rest.split_at(len))
}

/// 64-bit FNV-1a: the file name of a key (the file itself holds the whole key) and the
/// checksum of an image.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> KernelCache {
        let dir = std::env::temp_dir().join(format!("attn-kernel-cache-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        KernelCache::at(dir)
    }

    #[test]
    fn images_come_back_for_their_own_key_only() {
        let cache = scratch("round-trip");
        let key = image_key((13, 0), &["--gpu-architecture=sm_90".into()], "__global__ void k() {}");
        assert_eq!(cache.get(&key), None);
        cache.put(&key, b"\x7fELF cubin", ImageKind::Cubin).unwrap();
        assert_eq!(cache.get(&key), Some((b"\x7fELF cubin".to_vec(), ImageKind::Cubin)));
        // An image that does not look like its kind is never handed out.
        cache.put(&key, b"not an ELF", ImageKind::Cubin).unwrap();
        assert_eq!(cache.get(&key), None);
        cache.put(&key, b".version 8.0\0", ImageKind::Ptx).unwrap();
        assert_eq!(cache.get(&key), None);
        cache.put(&key, b".version 8.0", ImageKind::Ptx).unwrap();
        assert_eq!(cache.get(&key), Some((b".version 8.0".to_vec(), ImageKind::Ptx)));
        // Another NVRTC, option list or source is another key.
        for other in [
            image_key((12, 9), &["--gpu-architecture=sm_90".into()], "__global__ void k() {}"),
            image_key((13, 0), &["--gpu-architecture=sm_80".into()], "__global__ void k() {}"),
            image_key((13, 0), &["--gpu-architecture=sm_90".into()], "__global__ void j() {}"),
            image_key((13, 0), &["--gpu-architecture=sm_90".into(), String::new()], "__global__ void k() {}"),
        ] {
            assert_ne!(other, key);
            assert_eq!(cache.get(&other), None);
        }
        // A file under the key's name that holds another key (a hash collision) is a miss.
        let stranger = image_key((13, 0), &[], "other");
        cache.put(&stranger, b"other image", ImageKind::Cubin).unwrap();
        fs::copy(cache.file(&stranger), cache.file(&key)).unwrap();
        assert_eq!(cache.get(&key), None);
        let _ = fs::remove_dir_all(cache.dir());
    }

    #[test]
    fn damaged_files_are_misses() {
        let cache = scratch("damaged");
        let key = image_key((13, 0), &[], "src");
        cache.put(&key, b"\x7fELF image bytes", ImageKind::Cubin).unwrap();
        let whole = fs::read(cache.file(&key)).unwrap();
        for cut in [0, 4, 8, 12, whole.len() - 1] {
            fs::write(cache.file(&key), &whole[..cut]).unwrap();
            assert_eq!(cache.get(&key), None, "cut at {cut}");
        }
        let mut longer = whole.clone();
        longer.push(0);
        fs::write(cache.file(&key), &longer).unwrap();
        assert_eq!(cache.get(&key), None, "trailing byte");
        let mut kind = whole.clone();
        kind[8 + 8 + key.len()] = 7;
        fs::write(cache.file(&key), &kind).unwrap();
        assert_eq!(cache.get(&key), None, "unknown kind");
        // A flipped byte anywhere in the image: its checksum no longer matches.
        let image_at = 8 + 8 + key.len() + 1 + 8;
        for at in [image_at, image_at + 5, whole.len() - 9] {
            let mut flipped = whole.clone();
            flipped[at] ^= 0x20;
            fs::write(cache.file(&key), &flipped).unwrap();
            assert_eq!(cache.get(&key), None, "byte {at} flipped");
        }
        fs::write(cache.file(&key), &whole).unwrap();
        assert!(cache.get(&key).is_some(), "the intact file");
        // No temporary file is left behind.
        let names: Vec<_> = fs::read_dir(cache.dir()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names.len(), 1, "{names:?}");
        let _ = fs::remove_dir_all(cache.dir());
    }

    #[test]
    fn the_environment_names_the_directory() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| pairs.iter().find(|(k, _)| *k == name).map(|(_, v)| OsString::from(v))
        };
        let at = |dir: &str| Some(KernelCache::at(dir));
        assert_eq!(KernelCache::from_vars(vars(&[("ATTN_CUDA_CACHE_DIR", "/k"), ("HOME", "/h")])), at("/k"));
        for off in ["off", "OFF", "None", "0", "false", ""] {
            let named = move |name: &str| match name {
                "ATTN_CUDA_CACHE_DIR" => Some(OsString::from(off)),
                "HOME" => Some(OsString::from("/h")),
                _ => None,
            };
            assert_eq!(KernelCache::from_vars(named), None, "{off:?}");
        }
        // Relative bases are ignored (XDG); a relative ATTN_CUDA_CACHE_DIR is the caller's.
        let relative = vars(&[("XDG_CACHE_HOME", "cache"), ("HOME", "/h")]);
        assert_eq!(KernelCache::from_vars(relative), at("/h/.cache/attn/cuda-kernels"));
        assert_eq!(KernelCache::from_vars(vars(&[("HOME", "h")])), None);
        assert_eq!(KernelCache::from_vars(vars(&[("ATTN_CUDA_CACHE_DIR", "k")])), at("k"));
        let xdg = vars(&[("XDG_CACHE_HOME", "/x"), ("HOME", "/h")]);
        assert_eq!(KernelCache::from_vars(xdg), at("/x/attn/cuda-kernels"));
        assert_eq!(
            KernelCache::from_vars(vars(&[("XDG_CACHE_HOME", ""), ("HOME", "/h")])),
            at("/h/.cache/attn/cuda-kernels")
        );
        assert_eq!(KernelCache::from_vars(vars(&[])), None);
    }

    #[cfg(unix)]
    #[test]
    fn a_directory_others_can_write_is_never_read() {
        use std::os::unix::fs::PermissionsExt;
        let cache = scratch("shared");
        let key = image_key((13, 0), &[], "src");
        cache.put(&key, b"\x7fELF image", ImageKind::Cubin).unwrap();
        // Created for the owner alone, whatever the umask.
        assert_eq!(fs::metadata(cache.dir()).unwrap().permissions().mode() & 0o777, 0o700);
        assert!(cache.get(&key).is_some());
        fs::set_permissions(cache.dir(), fs::Permissions::from_mode(0o777)).unwrap();
        assert_eq!(cache.get(&key), None, "a world-writable directory");
        fs::set_permissions(cache.dir(), fs::Permissions::from_mode(0o775)).unwrap();
        assert!(cache.get(&key).is_some(), "a group-writable directory");
        let _ = fs::remove_dir_all(cache.dir());
    }

    #[test]
    fn a_write_removes_images_unused_for_a_month_and_a_read_keeps_one() {
        let cache = scratch("unused");
        let keys = ["stale", "read", "recent"].map(|src| image_key((13, 0), &[], src));
        for k in &keys {
            cache.put(k, b"\x7fELF image", ImageKind::Cubin).unwrap();
        }
        let ago = |days: u64| std::time::SystemTime::now() - std::time::Duration::from_secs(days * 24 * 3600);
        let age = |k: &[u8], days| fs::File::options().write(true).open(cache.file(k)).unwrap().set_modified(ago(days));
        age(&keys[0], UNUSED_DAYS + 1).unwrap();
        age(&keys[1], UNUSED_DAYS + 1).unwrap();
        age(&keys[2], UNUSED_DAYS - 1).unwrap();
        assert!(cache.get(&keys[1]).is_some(), "a read marks its file used");
        cache.put(&image_key((13, 0), &[], "new"), b"\x7fELF image", ImageKind::Cubin).unwrap();
        assert!(!cache.file(&keys[0]).exists(), "an image unused for a month is removed");
        assert!(cache.get(&keys[1]).is_some(), "the image just read stays");
        assert!(cache.get(&keys[2]).is_some(), "an image used within the month stays");
        let _ = fs::remove_dir_all(cache.dir());
    }

    #[test]
    fn a_write_removes_temporaries_a_killed_writer_left() {
        let cache = scratch("stale");
        fs::create_dir_all(cache.dir()).unwrap();
        let (old, new) = (cache.dir().join(".0.1.2.3.tmp"), cache.dir().join(".0.1.2.4.tmp"));
        for f in [&old, &new] {
            fs::write(f, b"half an image").unwrap();
        }
        let two_hours_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(7200);
        fs::File::options().write(true).open(&old).unwrap().set_modified(two_hours_ago).unwrap();
        cache.put(&image_key((13, 0), &[], "src"), b"\x7fELF image", ImageKind::Cubin).unwrap();
        assert!(!old.exists(), "an hour-old temporary is removed");
        assert!(new.exists(), "a write in progress elsewhere is left alone");
        let _ = fs::remove_dir_all(cache.dir());
    }
}
