//! The agent's footprint in the host's CNI setup: the `meshpath-cni` binary in the CNI bin
//! directory and a `{"type": "meshpath-cni"}` entry appended to the plugin chain of the
//! configuration the runtime uses: the first `.conf`, `.conflist` or `.json` by name, as libcni
//! (containerd, CRI-O) picks; a single-plugin configuration is turned into a list (same name,
//! `.conflist`), as istio-cni does. Checked every second: if another agent rewrites the file
//! without our entry, it is put back. `uninstall` removes both.

use std::{
    fs,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::Context as _;
use serde_json::{json, Value};
use tracing::{info, warn};

/// The plugin's type (and binary name).
pub const PLUGIN: &str = "meshpath-cni";

/// The configuration the runtime uses: the first `*.conf`, `*.conflist` or `*.json` by name.
pub fn primary_conflist(conf_dir: &Path) -> anyhow::Result<Option<PathBuf>> {
    let mut lists: Vec<PathBuf> = fs::read_dir(conf_dir)
        .with_context(|| format!("reading {}", conf_dir.display()))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "conflist" || x == "conf" || x == "json"))
        .collect();
    lists.sort();
    Ok(lists.into_iter().next())
}

/// Writes aside and renames into place; `mode`, if given, is set before the rename (a binary is
/// never there without its execute bit).
fn write_atomic(path: &Path, bytes: &[u8], mode: Option<u32>) -> anyhow::Result<()> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let tmp = path.with_file_name(format!(".{name}.meshpath-tmp"));
    fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    if let Some(mode) = mode {
        fs::set_permissions(&tmp, std::os::unix::fs::PermissionsExt::from_mode(mode))?;
    }
    fs::rename(&tmp, path).with_context(|| format!("replacing {}", path.display()))?;
    Ok(())
}

fn our_entry(socket: &Path) -> Value {
    json!({"type": PLUGIN, "agentSocket": socket.display().to_string()})
}

/// Makes sure the chain in `conflist` ends with our entry; returns whether it changed the file.
pub fn ensure_entry(conflist: &Path, socket: &Path) -> anyhow::Result<bool> {
    let text =
        fs::read_to_string(conflist).with_context(|| format!("reading {}", conflist.display()))?;
    let mut conf: Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not JSON; not touching it", conflist.display()))?;
    if conf.get("plugins").is_none() && conf.get("type").is_some() {
        // A single-plugin configuration: made a list (`<name>.conflist`), ending with ours.
        let list = json!({
            "cniVersion": conf.get("cniVersion").cloned().unwrap_or_else(|| json!("1.0.0")),
            "name": conf.get("name").cloned().unwrap_or_else(|| json!("k8s-pod-network")),
            "plugins": [conf, our_entry(socket)],
        });
        let to = conflist.with_extension("conflist");
        write_atomic(&to, serde_json::to_string_pretty(&list)?.as_bytes(), None)?;
        if to != conflist {
            fs::remove_file(conflist)
                .with_context(|| format!("removing {}", conflist.display()))?;
        }
        return Ok(true);
    }
    let plugins = conf
        .get_mut("plugins")
        .and_then(Value::as_array_mut)
        .with_context(|| format!("{} has no plugins list; not touching it", conflist.display()))?;
    let want = our_entry(socket);
    let ours: Vec<usize> = plugins
        .iter()
        .enumerate()
        .filter(|(_, p)| p.get("type").and_then(Value::as_str) == Some(PLUGIN))
        .map(|(i, _)| i)
        .collect();
    if ours.len() == 1 && plugins.last() == Some(&want) {
        return Ok(false);
    }
    plugins.retain(|p| p.get("type").and_then(Value::as_str) != Some(PLUGIN));
    plugins.push(want);
    write_atomic(conflist, serde_json::to_string_pretty(&conf)?.as_bytes(), None)?;
    Ok(true)
}

/// Copies the plugin binary into `bin_dir` if it differs.
pub fn install_binary(plugin: &Path, bin_dir: &Path) -> anyhow::Result<bool> {
    let bytes =
        fs::read(plugin).with_context(|| format!("reading the plugin {}", plugin.display()))?;
    let dst = bin_dir.join(PLUGIN);
    if fs::read(&dst).is_ok_and(|b| b == bytes) {
        return Ok(false);
    }
    fs::create_dir_all(bin_dir)?;
    write_atomic(&dst, &bytes, Some(0o755))?;
    Ok(true)
}

/// Installs now and keeps the entry in place.
pub fn spawn(plugin: PathBuf, bin_dir: PathBuf, conf_dir: PathBuf, socket: PathBuf) {
    let once = move || -> anyhow::Result<()> {
        if install_binary(&plugin, &bin_dir)? {
            info!(bin = %bin_dir.join(PLUGIN).display(), "CNI plugin installed");
        }
        match primary_conflist(&conf_dir)? {
            Some(list) => {
                if ensure_entry(&list, &socket)? {
                    info!(conflist = %list.display(), "meshpath-cni entry added to the CNI chain");
                }
            }
            None => {
                warn!(dir = %conf_dir.display(), "no CNI configuration list yet; waiting for the network plugin to write one")
            }
        }
        Ok(())
    };
    tokio::spawn(async move {
        loop {
            if let Err(e) = once() {
                warn!(error = %format!("{e:#}"), "CNI installation check failed");
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    });
}

/// Removes our entry from every configuration list in `conf_dir` and the binary.
pub fn uninstall(bin_dir: &Path, conf_dir: &Path) -> anyhow::Result<()> {
    for entry in
        fs::read_dir(conf_dir).with_context(|| format!("reading {}", conf_dir.display()))?.flatten()
    {
        let path = entry.path();
        if path.extension().is_none_or(|x| x != "conflist" && x != "conf" && x != "json") {
            continue;
        }
        let Ok(mut conf) = fs::read_to_string(&path)
            .map_err(anyhow::Error::from)
            .and_then(|t| Ok(serde_json::from_str::<Value>(&t)?))
        else {
            continue;
        };
        let Some(plugins) = conf.get_mut("plugins").and_then(Value::as_array_mut) else { continue };
        let before = plugins.len();
        plugins.retain(|p| p.get("type").and_then(Value::as_str) != Some(PLUGIN));
        if plugins.len() != before {
            write_atomic(&path, serde_json::to_string_pretty(&conf)?.as_bytes(), None)?;
            info!(conflist = %path.display(), "meshpath-cni entry removed");
        }
    }
    match fs::remove_file(bin_dir.join(PLUGIN)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e.into()),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "meshpath-cni-install-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).expect("dir");
        d
    }

    const BRIDGE: &str = r#"{"cniVersion":"1.0.0","name":"k8s","plugins":[{"type":"bridge","bridge":"cni0"},{"type":"portmap"}]}"#;

    #[test]
    fn the_entry_is_appended_once_and_kept_last() {
        let d = dir();
        let list = d.join("10-k8s.conflist");
        fs::write(&list, BRIDGE).expect("write");
        let sock = Path::new("/run/m.sock");
        assert!(ensure_entry(&list, sock).expect("ensure"));
        assert!(!ensure_entry(&list, sock).expect("again"), "changed an already right file");
        let conf: Value =
            serde_json::from_str(&fs::read_to_string(&list).expect("read")).expect("json");
        let types: Vec<&str> = conf["plugins"]
            .as_array()
            .expect("plugins")
            .iter()
            .filter_map(|p| p["type"].as_str())
            .collect();
        assert_eq!(types, ["bridge", "portmap", PLUGIN]);
        let _ = fs::remove_dir_all(&d);
    }

    #[test]
    fn a_rewritten_file_gets_the_entry_back_and_uninstall_removes_it() {
        let d = dir();
        let list = d.join("10-k8s.conflist");
        fs::write(&list, BRIDGE).expect("write");
        let sock = Path::new("/run/m.sock");
        ensure_entry(&list, sock).expect("ensure");
        fs::write(&list, BRIDGE).expect("another agent rewrites it");
        assert!(ensure_entry(&list, sock).expect("repair"));
        uninstall(&d, &d).expect("uninstall");
        let conf: Value =
            serde_json::from_str(&fs::read_to_string(&list).expect("read")).expect("json");
        assert_eq!(conf["plugins"].as_array().map(Vec::len), Some(2));
        let _ = fs::remove_dir_all(&d);
    }

    #[test]
    fn the_first_configuration_by_name_is_the_one_used_as_libcni_picks() {
        let d = dir();
        fs::write(d.join("20-b.conflist"), BRIDGE).expect("write");
        fs::write(d.join("10-a.conflist"), BRIDGE).expect("write");
        fs::write(d.join("05-x.conf"), "{}").expect("write");
        fs::write(d.join("01-notes.txt"), "").expect("write");
        assert_eq!(primary_conflist(&d).expect("list"), Some(d.join("05-x.conf")));
        let _ = fs::remove_dir_all(&d);
    }

    #[test]
    fn a_single_plugin_configuration_becomes_a_list_ending_with_the_entry() {
        let d = dir();
        let conf = d.join("10-bridge.conf");
        fs::write(&conf, r#"{"cniVersion":"1.0.0","name":"k8s","type":"bridge","bridge":"cni0"}"#)
            .expect("write");
        assert!(ensure_entry(&conf, Path::new("/run/m.sock")).expect("ensure"));
        assert!(!conf.exists(), "the single-plugin file is still there");
        let text = fs::read_to_string(d.join("10-bridge.conflist")).expect("read");
        let list: Value = serde_json::from_str(&text).expect("json");
        assert_eq!(list["name"], "k8s");
        assert_eq!(list["plugins"][0]["type"], "bridge");
        assert_eq!(list["plugins"][1]["type"], PLUGIN);
        let _ = fs::remove_dir_all(&d);
    }
}
