//! The kernels run the best path this CPU offers: the ISA picked at run time (without
//! `ATTN_CPU_ISA`) is the one the CPU flags in `/proc/cpuinfo` allow, read independently
//! of the kernels' own detection. `.ci/run` prints this test's line, so a runner whose
//! fast path goes unused (AMX, AVX512-BF16) shows it.
#![cfg(all(target_os = "linux", target_arch = "x86_64"))]

use std::collections::HashSet;

use attn_kernels::Isa;

/// The value of the first processor's `key` line in `/proc/cpuinfo`.
fn cpuinfo(key: &str) -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").expect("/proc/cpuinfo is readable on Linux");
    let line = info.lines().find(|l| l.split(':').next().is_some_and(|k| k.trim() == key));
    line.unwrap_or_else(|| panic!("a {key} line")).split(':').nth(1).unwrap_or_default().trim().to_string()
}

/// The flags of the first processor in `/proc/cpuinfo`.
fn cpu_flags() -> HashSet<String> {
    cpuinfo("flags").split_whitespace().map(str::to_string).collect()
}

/// The best ISA the flags allow (AMX also needs Linux to grant the tile state, which
/// flags cannot show: that part is taken from the kernels' own probe). AVX512-BF16 pays
/// only on AMD, whose `vdpbf16ps` issues at the FMA rate.
fn best_by_flags(flags: &HashSet<String>, vendor: &str) -> Isa {
    let has = |f: &str| flags.contains(f);
    if has("amx_bf16") && has("amx_tile") && has("avx512_bf16") && Isa::Amx.is_supported() {
        Isa::Amx
    } else if has("avx512f") && has("avx512_bf16") && vendor == "AuthenticAMD" {
        Isa::Avx512Bf16
    } else if has("avx512f") {
        Isa::Avx512
    } else if has("avx2") && has("fma") {
        Isa::Avx2
    } else {
        Isa::Portable
    }
}

#[test]
fn the_detected_isa_is_the_best_the_cpu_flags_allow() {
    let (flags, vendor) = (cpu_flags(), cpuinfo("vendor_id"));
    let best = best_by_flags(&flags, &vendor);
    match std::env::var("ATTN_CPU_ISA") {
        Ok(forced) => {
            let forced = Isa::parse(&forced).expect("ATTN_CPU_ISA names an ISA");
            println!(
                "kernel ISA: {} (forced by ATTN_CPU_ISA; the CPU allows {})",
                Isa::detect().as_str(),
                best.as_str()
            );
            assert_eq!(Isa::detect(), if forced.is_supported() { forced } else { Isa::best() });
        }
        Err(_) => {
            println!(
                "kernel ISA: {} (the best this {vendor} CPU's flags allow: {})",
                Isa::detect().as_str(),
                best.as_str()
            );
            assert_eq!(Isa::detect(), best, "the kernels do not use the best path this CPU offers");
        }
    }
    for isa in Isa::ALL {
        println!("  {:<10} {}", isa.as_str(), if isa.is_supported() { "available" } else { "not on this CPU/OS" });
    }
}

/// Every name in `ATTN_REQUIRE_ISA` is an ISA as `Isa::as_str` prints it: a misspelt name
/// would require nothing.
#[test]
fn required_isa_names_are_isas() {
    for name in attn_testkit::isa_policy::required_isas() {
        let known = Isa::ALL.map(Isa::as_str);
        assert!(known.contains(&name.as_str()), "ATTN_REQUIRE_ISA: `{name}` is not one of {known:?}");
    }
}
