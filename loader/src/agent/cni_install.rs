//! The agent's footprint in the host's CNI setup: the `meshpath-cni` binary in the CNI bin
//! directory and a `{"type": "meshpath-cni"}` entry appended to the plugin chain of the
//! configuration the runtime uses (the first `.conflist` by name, as kubelet and containerd
//! pick). Checked every second: if another agent rewrites the file without our entry, it is put
//! back. `uninstall` removes both.

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

/// The configuration list the runtime uses: the first `*.conflist` by name.
pub fn primary_conflist(conf_dir: &Path) -> anyhow::Result<Option<PathBuf>> {
    let mut lists: Vec<PathBuf> = fs::read_dir(conf_dir)
        .with_context(|| format!("reading {}", conf_dir.display()))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "conflist"))
        .collect();
    lists.sort();
    Ok(lists.into_iter().next())
}

fn write_atomic(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let tmp = path.with_file_name(format!(".{name}.meshpath-tmp"));
    fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
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
    write_atomic(conflist, serde_json::to_string_pretty(&conf)?.as_bytes())?;
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
    write_atomic(&dst, &bytes)?;
    fs::set_permissions(&dst, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
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
        if path.extension().is_none_or(|x| x != "conflist") {
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
            write_atomic(&path, serde_json::to_string_pretty(&conf)?.as_bytes())?;
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
    fn the_first_conflist_by_name_is_the_one_used() {
        let d = dir();
        fs::write(d.join("20-b.conflist"), BRIDGE).expect("write");
        fs::write(d.join("10-a.conflist"), BRIDGE).expect("write");
        fs::write(d.join("05-x.conf"), "{}").expect("write");
        assert_eq!(primary_conflist(&d).expect("list"), Some(d.join("10-a.conflist")));
        let _ = fs::remove_dir_all(&d);
    }
}
