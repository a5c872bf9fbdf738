//! Where the workspace is and which cargo runs the tasks.

use std::path::PathBuf;

/// The workspace root (xtask lives one level below it).
pub fn repo_root() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().map_or(manifest.clone(), |p| p.to_path_buf())
}

/// The cargo that runs us (or `cargo`).
pub fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())
}
