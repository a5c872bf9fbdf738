//! `attn-ptx`: compile every CUDA kernel with NVRTC for each requested architecture,
//! assemble the PTX with `ptxas -v`, print registers / shared memory / spills per kernel,
//! and fail on any compile error, missing kernel or spill. Needs no GPU, only libnvrtc
//! (found as `attn_kernels::cuda::nvrtc_library` says) and `ptxas`. Run through `cargo xtask ptx`.
//! `--fill-cache DIR` instead writes the modules a device of each architecture loads
//! (every dtype) into the kernel cache in DIR, for a machine that should not compile them.
//!
//! An architecture with the suffix `a` (`90a`) compiles for its architecture-specific
//! features and expects the kernels that need them too (`sm90a_kernel_names_for`).
//!
//! Usage: attn-ptx [--arch 80,90,90a] [--out DIR] [--ptxas PATH] [--fill-cache DIR]

use std::path::PathBuf;
use std::process::{Command, ExitCode};
use std::sync::atomic::{AtomicUsize, Ordering};

use attn_kernels::cuda::kernel_cache::KernelCache;
use attn_kernels::cuda::nvrtc::{ArchFeatures, Target, compile_into, compile_ptx};
use attn_kernels::cuda::nvrtc_library;
use attn_kernels::cuda::plan::{
    BackwardDq, BackwardKeys, BackwardLoads, BackwardOptions, ForwardOptions, ForwardRows, ForwardStages,
    mma_bwd_dq_smem_bytes, mma_bwd_smem_bytes, mma_smem_bytes,
};
use attn_kernels::cuda::source::{
    MMA_BWD_HEAD_DIMS, MMA_HEAD_DIMS, WGMMA_HEAD_DIMS, dtype_define, full_source, kernel_names_for,
    mma_bwd_dq_kernel_name, mma_bwd_kernel_name, mma_fused_kernel_name, mma_kernel_name, nvrtc_options,
    sm90a_kernel_names_for, wgmma_fwd_kernel_name, wgmma_fwd_smem_bytes,
};

#[derive(Debug, Default, Clone)]
struct KernelReport {
    registers: u32,
    static_smem: u32,
    stack: u32,
    spill_stores: u32,
    spill_loads: u32,
}

struct Args {
    archs: Vec<String>,
    out: PathBuf,
    ptxas: String,
    fill_cache: Option<PathBuf>,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        archs: vec!["80".into(), "90".into(), "90a".into()],
        out: PathBuf::from("target/ptx"),
        ptxas: "ptxas".into(),
        fill_cache: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--arch" => a.archs = val()?.split(',').map(|s| s.trim().trim_start_matches("sm_").to_string()).collect(),
            "--out" => a.out = PathBuf::from(val()?),
            "--ptxas" => a.ptxas = val()?,
            "--fill-cache" => a.fill_cache = Some(PathBuf::from(val()?)),
            "-h" | "--help" => {
                return Err("usage: attn-ptx [--arch 80,90,90a] [--out DIR] [--ptxas PATH] [--fill-cache DIR]".into());
            }
            other => return Err(format!("unknown argument `{other}`")),
        }
    }
    let digits = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_digit());
    if a.archs.iter().any(|s| !digits(s.strip_suffix('a').unwrap_or(s))) {
        return Err(format!("bad --arch list {:?} (want e.g. 80,90,90a)", a.archs));
    }
    Ok(a)
}

/// Numbers before a word, e.g. `n_before(line, "registers")` on "Used 40 registers".
fn n_before(line: &str, word: &str) -> Option<u32> {
    let words: Vec<&str> = line.split(|c: char| c.is_whitespace() || c == ',').filter(|s| !s.is_empty()).collect();
    words.windows(2).find(|w| w[1].starts_with(word)).and_then(|w| w[0].parse().ok())
}

/// Parse `ptxas -v` output into per-kernel reports.
fn parse_ptxas(text: &str) -> Vec<(String, KernelReport)> {
    let mut out: Vec<(String, KernelReport)> = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.split("Function properties for ").nth(1) {
            out.push((rest.trim().to_string(), KernelReport::default()));
        } else if let Some((_, r)) = out.last_mut() {
            if line.contains("stack frame") {
                r.stack = n_before(line, "bytes").unwrap_or(0);
                r.spill_stores = line
                    .split("spill stores")
                    .next()
                    .and_then(|s| s.split(',').next_back())
                    .and_then(|s| n_before(s, "bytes"))
                    .unwrap_or(0);
                r.spill_loads = line
                    .split("spill loads")
                    .next()
                    .and_then(|s| s.split(',').next_back())
                    .and_then(|s| n_before(s, "bytes"))
                    .unwrap_or(0);
            } else if line.contains("Used") && line.contains("registers") {
                r.registers = n_before(line, "registers").unwrap_or(0);
                r.static_smem =
                    line.split(',').find(|s| s.contains("smem")).and_then(|s| n_before(s, "bytes")).unwrap_or(0);
            }
        }
    }
    out
}

/// Dynamic shared memory a kernel is launched with (0 for the row kernels).
fn dynamic_smem(name: &str) -> usize {
    for t in ["f16", "bf16"] {
        for d in WGMMA_HEAD_DIMS {
            if name == wgmma_fwd_kernel_name(t, d) {
                return wgmma_fwd_smem_bytes(d);
            }
        }
        for stages in ForwardStages::ALL {
            for rows in ForwardRows::ALL {
                let opts = ForwardOptions { rows, stages, ..ForwardOptions::default() };
                for d in MMA_HEAD_DIMS {
                    if name == mma_kernel_name(t, d, rows, stages) {
                        return mma_smem_bytes(opts, d);
                    }
                }
            }
            for d in MMA_HEAD_DIMS {
                if name == mma_fused_kernel_name(t, d, stages) {
                    return mma_smem_bytes(ForwardOptions { stages, ..ForwardOptions::default() }, d);
                }
            }
        }
        for d in MMA_BWD_HEAD_DIMS {
            if name == mma_bwd_dq_kernel_name(t, d) {
                return mma_bwd_dq_smem_bytes(d);
            }
        }
        for loads in BackwardLoads::ALL {
            for keys in BackwardKeys::ALL {
                for dq in BackwardDq::ALL {
                    let opts = BackwardOptions { loads, keys, dq, ..BackwardOptions::default() };
                    for d in MMA_BWD_HEAD_DIMS {
                        if name == mma_bwd_kernel_name(t, d, opts) {
                            return mma_bwd_smem_bytes(d, opts);
                        }
                    }
                }
            }
        }
    }
    0
}

/// `90` (compute capability 9.0) or `90a` (the same with its architecture-specific
/// features, as a device running the wgmma forward compiles it).
fn parse_target(a: &str) -> Result<Target, String> {
    let (digits, features) = match a.strip_suffix('a') {
        Some(d) => (d, ArchFeatures::Specific),
        None => (a, ArchFeatures::Portable),
    };
    let n = digits.parse::<i32>().map_err(|e| format!("--arch {a}: {e}"))?;
    Ok(Target { cc: (n / 10, n % 10), features })
}

/// The module of every dtype for every architecture in `archs` ([`parse_target`]),
/// compiled as a device of that architecture compiles it and kept in `cache`; the
/// compiles run in parallel.
fn fill_cache(archs: &[String], cache: &KernelCache) -> Result<(), String> {
    let src = full_source();
    let jobs: Vec<(Target, &str)> = archs
        .iter()
        .map(|a| parse_target(a))
        .collect::<Result<Vec<_>, _>>()?
        .into_iter()
        .flat_map(|target| ["f32", "bf16", "f16"].map(|d| (target, d)))
        .collect();
    std::thread::scope(|scope| {
        let handles: Vec<_> = jobs
            .iter()
            .map(|&(target, dtype)| {
                let src = &src;
                scope.spawn(move || -> Result<String, String> {
                    let extra = [dtype_define(dtype).map_err(|e| e.to_string())?];
                    let image = compile_into(src, target, &extra, Some(cache)).map_err(|e| e.to_string())?;
                    let arch = target.arch();
                    Ok(format!("sm_{arch} {dtype}: {:?}, {} bytes", image.kind, image.bytes.len()))
                })
            })
            .collect();
        for h in handles {
            println!("{}", h.join().map_err(|_| "a compile thread panicked".to_string())??);
        }
        Ok::<(), String>(())
    })?;
    // A cache that could not be written (compile_into keeps going) is a failure here.
    let files = std::fs::read_dir(cache.dir()).map_err(|e| format!("{}: {e}", cache.dir().display()))?.count();
    if files < jobs.len() {
        return Err(format!("{} holds {files} files, want {}", cache.dir().display(), jobs.len()));
    }
    println!("attn-ptx: {} modules kept in {}", jobs.len(), cache.dir().display());
    Ok(())
}

fn run() -> Result<(), String> {
    let args = parse_args()?;
    nvrtc_library().map_err(|e| e.to_string())?;
    if let Some(dir) = &args.fill_cache {
        return fill_cache(&args.archs, &KernelCache::at(dir));
    }
    std::fs::create_dir_all(&args.out).map_err(|e| format!("create {}: {e}", args.out.display()))?;
    let src = full_source();
    // One module per dtype, exactly as the runtime compiles them; the modules compile and
    // assemble on a pool of the machine's cores, their reports printed in order.
    let jobs: Vec<(&str, &str)> =
        args.archs.iter().flat_map(|arch| ["f32", "f16", "bf16"].map(|suffix| (arch.as_str(), suffix))).collect();
    let next = AtomicUsize::new(0);
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get()).min(jobs.len());
    let mut checks: Vec<Option<Result<ModuleCheck, String>>> = (0..jobs.len()).map(|_| None).collect();
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                let (src, args, jobs, next) = (&src, &args, &jobs, &next);
                scope.spawn(move || {
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&(arch, suffix)) = jobs.get(i) else { break done };
                        done.push((i, check_module(args, src, arch, suffix)));
                    }
                })
            })
            .collect();
        for h in handles {
            for (i, check) in h.join().map_err(|_| "a compile thread panicked".to_string())? {
                checks[i] = Some(check);
            }
        }
        Ok::<(), String>(())
    })?;
    let (mut failures, mut total) = (Vec::new(), 0);
    for check in checks.into_iter().flatten() {
        let check = check?;
        print!("{}", check.report);
        total += check.kernels;
        failures.extend(check.failures);
    }
    if failures.is_empty() {
        println!(
            "attn-ptx: {total} kernels ({} per arch) compiled and assembled, no spills",
            total / args.archs.len().max(1)
        );
        Ok(())
    } else {
        Err(failures.join("\n"))
    }
}

/// What checking one module found: its printed table, how many kernels it should hold,
/// and each failure (a kernel missing, unexpected, spilling or over the shared memory).
struct ModuleCheck {
    report: String,
    kernels: usize,
    failures: Vec<String>,
}

/// Compile the `suffix` module for `arch` with NVRTC, assemble it with `ptxas -v` and
/// check every kernel's report; a compile or assembler failure is an error.
fn check_module(args: &Args, src: &str, arch: &str, suffix: &str) -> Result<ModuleCheck, String> {
    let mut options = nvrtc_options(&format!("compute_{arch}"));
    options.push(dtype_define(suffix).map_err(|e| e.to_string())?);
    let text_ptx = compile_ptx(src, &options)
        .map_err(|e| format!("NVRTC compile of the {suffix} module for compute_{arch} failed:\n{e}"))?;
    let ptx_path = args.out.join(format!("attn_kernels_{suffix}_sm_{arch}.ptx"));
    let cubin_path = args.out.join(format!("attn_kernels_{suffix}_sm_{arch}.cubin"));
    std::fs::write(&ptx_path, &text_ptx).map_err(|e| format!("write {}: {e}", ptx_path.display()))?;
    let output = Command::new(&args.ptxas)
        .arg("-v")
        .arg(format!("-arch=sm_{arch}"))
        .arg(&ptx_path)
        .arg("-o")
        .arg(&cubin_path)
        .output()
        .map_err(|e| format!("run `{}`: {e}", args.ptxas))?;
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    if !output.status.success() {
        return Err(format!("ptxas -arch=sm_{arch} failed on {} ({}):\n{text}", ptx_path.display(), output.status));
    }
    let reports = parse_ptxas(&text);
    let mut expected = kernel_names_for(suffix);
    if arch.ends_with('a') {
        expected.extend(sm90a_kernel_names_for(suffix));
    }
    let mut failures = Vec::new();
    let mut report = format!("sm_{arch} {suffix}: {} ({} bytes of PTX)\n", ptx_path.display(), text_ptx.len());
    report += &format!(
        "  {:<34} {:>5} {:>9} {:>9} {:>6} {:>12}\n",
        "kernel", "regs", "smem", "dyn smem", "stack", "spill st/ld"
    );
    for name in &expected {
        let Some((_, r)) = reports.iter().find(|(n, _)| n == name) else {
            failures.push(format!("sm_{arch}: kernel {name} missing from ptxas output"));
            continue;
        };
        report += &format!(
            "  {:<34} {:>5} {:>9} {:>9} {:>6} {:>6}/{:<5}\n",
            name,
            r.registers,
            r.static_smem,
            dynamic_smem(name),
            r.stack,
            r.spill_stores,
            r.spill_loads
        );
        if r.spill_stores > 0 || r.spill_loads > 0 {
            failures.push(format!("sm_{arch}: {name} spills ({} B stores, {} B loads)", r.spill_stores, r.spill_loads));
        }
        if dynamic_smem(name) + r.static_smem as usize > 163 * 1024 {
            failures.push(format!("sm_{arch}: {name} needs more shared memory than sm_80 has"));
        }
    }
    for (n, _) in &reports {
        if !expected.contains(n) {
            failures.push(format!("sm_{arch} {suffix}: unexpected kernel {n} (add it to source::kernel_names)"));
        }
    }
    Ok(ModuleCheck { report, kernels: expected.len(), failures })
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("attn-ptx: {e}");
            ExitCode::FAILURE
        }
    }
}
