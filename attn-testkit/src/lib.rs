//! Test kit for `attn` (a dev-dependency of the library crates; a dependency of the
//! unpublished runner and attack crates only): seeded tensors, proptest
//! strategies (plain and with the attention features), per-dtype tolerances, and the golden-file loader and checker.
#![forbid(unsafe_code)]

pub mod feature_case;
pub mod golden;
pub mod gpu_policy;
pub mod isa_policy;
pub mod judge;
pub mod layer_judge;
pub mod layer_stages;
pub mod problem;
pub mod rng;
pub mod split_error;
pub mod strategies;
pub mod tolerance;
pub mod typed;

pub use feature_case::{
    FeatureCase, feature_case, judge_gradients, judge_lse_gradients, unattended_rows_case, wide_head_cases,
};
pub use golden::{CaseReport, DilatedBackend, Forward32, GoldenCase, Gradients32, MultiheadBackend, MultiheadGrads32};
pub use gpu_policy::{gpu_or_skip, gpu_required, skip_gpu_test};
pub use rng::{SeededRng, random_vec};
pub use strategies::{DilatedCase, InvalidInput, proptest_cases};
pub use tolerance::{Tolerance, max_abs_error, rel_l2_error};
pub use typed::{Typed, reference};
