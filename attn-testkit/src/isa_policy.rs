//! Whether a test of one CPU instruction set may skip where the CPU lacks it: with
//! `ATTN_REQUIRE_ISA=<isa>[,<isa>...]` (names as attn-kernels' `Isa::as_str` prints them;
//! CI sets it to the ISAs its machine reports) a test of a named ISA that this CPU lacks
//! fails instead of checking nothing.

/// The environment variable naming the ISAs whose tests must run.
pub const REQUIRE_ISA_VAR: &str = "ATTN_REQUIRE_ISA";

/// The ISA names in `value` (comma-separated, blanks ignored).
pub fn parse_required(value: &str) -> Vec<String> {
    value.split(',').map(str::trim).filter(|s| !s.is_empty()).map(str::to_string).collect()
}

/// The ISA names `ATTN_REQUIRE_ISA` requires (none when unset).
pub fn required_isas() -> Vec<String> {
    std::env::var(REQUIRE_ISA_VAR).map(|v| parse_required(&v)).unwrap_or_default()
}

/// The message of a test of `isa` that cannot run here, or `None` where it may skip.
pub fn required_isa_failure(test: &str, isa: &str, required: &[String]) -> Option<String> {
    required
        .iter()
        .any(|r| r == isa)
        .then(|| format!("{test}: {REQUIRE_ISA_VAR} names {isa}, which this CPU (or OS) does not offer"))
}

/// Whether the test `test` of `isa` runs: `true` where the CPU offers it (`supported`);
/// else it prints `SKIP test: ...` and returns `false`, or panics when `required` (the
/// names `ATTN_REQUIRE_ISA` gives) holds `isa`.
pub fn isa_or_skip_given(test: &str, isa: &str, supported: bool, required: &[String]) -> bool {
    if supported {
        return true;
    }
    if let Some(msg) = required_isa_failure(test, isa, required) {
        panic!("{msg}");
    }
    println!("SKIP {test} on {isa}: this CPU (or OS) does not offer it");
    false
}

/// [`isa_or_skip_given`] with the names `ATTN_REQUIRE_ISA` gives.
pub fn isa_or_skip(test: &str, isa: &str, supported: bool) -> bool {
    isa_or_skip_given(test, isa, supported, &required_isas())
}

/// The `candidates` whose tests run here (see [`isa_or_skip`]): `name` gives an ISA's
/// `ATTN_REQUIRE_ISA` name, `supported` whether this CPU offers it.
pub fn runnable<I: Copy>(
    test: &str,
    candidates: impl IntoIterator<Item = I>,
    name: impl Fn(I) -> &'static str,
    supported: impl Fn(I) -> bool,
) -> Vec<I> {
    let required = required_isas();
    candidates.into_iter().filter(|&i| isa_or_skip_given(test, name(i), supported(i), &required)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_required_isa_turns_the_skip_into_a_failure_naming_it() {
        let required = parse_required(" avx512, amx ,,");
        assert_eq!(required, ["avx512", "amx"]);
        let msg = required_isa_failure("bf16_pairs", "amx", &required).expect("amx is required");
        assert!(msg.contains("bf16_pairs") && msg.contains("amx") && msg.contains(REQUIRE_ISA_VAR), "{msg}");
        assert_eq!(required_isa_failure("bf16_pairs", "avx512bf16", &required), None);
        assert_eq!(required_isa_failure("bf16_pairs", "amx", &[]), None);
    }

    /// An ISA the CPU lacks: skipped (the test runs on the others) unless required, when
    /// the test fails naming it.
    #[test]
    fn a_missing_isa_is_skipped_unless_required() {
        let required = parse_required("amx");
        assert!(isa_or_skip_given("bf16_pairs", "amx", true, &required));
        assert!(!isa_or_skip_given("bf16_pairs", "amx", false, &[]));
        assert!(!isa_or_skip_given("bf16_pairs", "avx2", false, &required));
        let failed = std::panic::catch_unwind(|| isa_or_skip_given("bf16_pairs", "amx", false, &required));
        let msg = failed.expect_err("a required ISA that is missing passed");
        let msg = msg.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(msg.contains("bf16_pairs") && msg.contains("amx"), "{msg}");
    }
}
