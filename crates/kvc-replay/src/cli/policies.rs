//! `kvc-replay policies`: the routing policies and their knobs.

use anyhow::Result;
use kvc_policy::PolicyConfig;

/// Options of `kvc-replay policies`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {}

/// Runs `kvc-replay policies`: each policy's name and its default knobs as JSON.
pub(crate) fn run(_args: Args) -> Result<()> {
    for name in PolicyConfig::all_names() {
        let cfg = PolicyConfig::from_name(name)?;
        println!("{name}");
        let value = serde_json::to_value(&cfg)?;
        if let Some(obj) = value.as_object() {
            for (k, v) in obj {
                if k != "policy" {
                    println!("    {k} = {v}");
                }
            }
        }
    }
    Ok(())
}
