//! Suite.
use crate::cli::SuiteOptions;
pub fn run(_o: &SuiteOptions) -> attn_core::Result<()> {
    Ok(())
}
