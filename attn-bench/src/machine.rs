//! What machine and build a run measured: CPU, the CPU kernel flavour, cores, memory,
//! rustc, git commit, time.

use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// Description of the machine and build, stored in `results.json` and the report.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Machine {
    pub cpu: String,
    /// The CPU kernel flavour the run used (`attn_kernels::Isa`: `amx`, `avx512bf16`,
    /// `avx512`, `avx2` or `portable`; `ATTN_CPU_ISA` overrides). Empty in results
    /// written before it was recorded.
    #[serde(default)]
    pub cpu_kernels: String,
    pub logical_cores: usize,
    pub memory_bytes: u64,
    pub os: String,
    pub rustc: String,
    pub git_commit: String,
    pub git_dirty: bool,
    pub timestamp_utc: String,
    pub gpu: Option<String>,
}

fn command_line(cmd: &str, args: &[&str]) -> Option<String> {
    let out = Command::new(cmd).args(args).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("model name")).map(|l| l.to_string()))
        .and_then(|l| l.split_once(':').map(|(_, v)| v.trim().to_string()))
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

/// A `/proc/meminfo` field (e.g. `MemTotal`) in bytes.
fn meminfo_bytes(key: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.split(':').next() == Some(key))?;
    line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kb| kb * 1024)
}

fn memory_bytes() -> u64 {
    meminfo_bytes("MemTotal").unwrap_or(0)
}

/// Memory the kernel says can be allocated now without swapping (`MemAvailable`), or
/// `None` where `/proc/meminfo` has no such field.
pub fn available_memory_bytes() -> Option<u64> {
    meminfo_bytes("MemAvailable")
}

/// The first GPU `nvidia-smi` lists, if the tool exists and sees one.
pub fn detect_gpu() -> Option<String> {
    command_line("nvidia-smi", &["--query-gpu=name,memory.total", "--format=csv,noheader"])
        .and_then(|s| s.lines().next().map(str::to_string))
        .filter(|s| !s.is_empty())
}

impl Machine {
    /// Probe the current machine (runs `rustc -V` and `git`; both optional).
    pub fn probe() -> Self {
        let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
        Machine {
            cpu: cpu_model(),
            cpu_kernels: attn_kernels::Isa::detect().as_str().into(),
            logical_cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            memory_bytes: memory_bytes(),
            os: format!(
                "{} {}",
                std::env::consts::OS,
                std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim()
            ),
            rustc: command_line(&rustc, &["-V"]).unwrap_or_else(|| "unknown".into()),
            git_commit: command_line("git", &["rev-parse", "HEAD"]).unwrap_or_else(|| "unknown".into()),
            git_dirty: command_line("git", &["status", "--porcelain", "--untracked-files=no"])
                .is_some_and(|s| !s.is_empty()),
            timestamp_utc: utc_timestamp(SystemTime::now()),
            gpu: detect_gpu(),
        }
    }
}

/// `YYYY-MM-DDTHH-MM-SSZ` (dashes, usable as a directory name).
pub fn utc_timestamp(t: SystemTime) -> String {
    let secs = t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(days as i64);
    format!("{y:04}-{m:02}-{d:02}T{:02}-{:02}-{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian (H. Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn timestamps_match_known_dates() {
        assert_eq!(utc_timestamp(UNIX_EPOCH), "1970-01-01T00-00-00Z");
        // 2024-02-29 12:34:56 UTC = 1709210096.
        assert_eq!(utc_timestamp(UNIX_EPOCH + Duration::from_secs(1_709_210_096)), "2024-02-29T12-34-56Z");
    }
}
