//! The few bpf(2) commands meshpath needs that aya 0.14 does not expose: creating and pinning a
//! cgroup getsockopt link (aya cannot turn that link into a pinnable `FdLink`), reading the
//! target of a pinned link (aya's `LinkInfo` hides it), which tells whether the pod it served
//! still exists, and detaching a pinned link at once; for upgrades in place, replacing a pinned
//! link's program and copying a map's entries byte for byte.

use std::{
    ffi::CString,
    fs::File,
    io,
    os::fd::{AsFd as _, AsRawFd as _, FromRawFd as _, OwnedFd},
    path::Path,
};

use aya::programs::CgroupSockopt;

const BPF_OBJ_PIN: libc::c_long = 6;
const BPF_OBJ_GET: libc::c_long = 7;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_LINK_DETACH: libc::c_long = 34;
/// `enum bpf_attach_type`: BPF_CGROUP_GETSOCKOPT.
const BPF_CGROUP_GETSOCKOPT: u32 = 21;

/// Size of `union bpf_attr` we pass: large enough for every command used here, zero-padded.
#[repr(C, align(8))]
struct Attr([u32; 32]);

/// `&mut`: the kernel writes into the attribute union for some commands (GET_INFO_BY_FD writes
/// the info length back).
fn bpf(cmd: libc::c_long, attr: &mut Attr) -> io::Result<i64> {
    // SAFETY: `attr` is a zero-padded bpf_attr of the size we pass, exclusively borrowed; the
    // kernel reads and writes only within it (and, for GET_INFO, through a pointer we set).
    let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr as *mut Attr, size_of::<Attr>()) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(rc)
}

fn path_cstring(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_encoded_bytes()).map_err(io::Error::other)
}

/// Attaches a loaded cgroup getsockopt program to `cgroup` with a bpf link pinned at `pin`.
pub fn link_cgroup_getsockopt(prog: &CgroupSockopt, cgroup: &File, pin: &Path) -> io::Result<()> {
    let prog_fd = prog.fd().map_err(io::Error::other)?.as_fd().as_raw_fd();
    let mut attr = Attr([0; 32]);
    // link_create: prog_fd, target_fd, attach_type, flags.
    attr.0[0] = prog_fd as u32;
    attr.0[1] = cgroup.as_raw_fd() as u32;
    attr.0[2] = BPF_CGROUP_GETSOCKOPT;
    let fd = bpf(BPF_LINK_CREATE, &mut attr)?;
    // SAFETY: the kernel just returned this descriptor to us.
    let link = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let path = path_cstring(pin)?;
    let mut attr = Attr([0; 32]);
    // obj_pin: pathname (u64), bpf_fd.
    let ptr = path.as_ptr() as u64;
    attr.0[0] = ptr as u32;
    attr.0[1] = (ptr >> 32) as u32;
    attr.0[2] = link.as_raw_fd() as u32;
    bpf(BPF_OBJ_PIN, &mut attr)?;
    Ok(())
}

/// `enum bpf_attach_type`: BPF_SK_MSG_VERDICT.
const BPF_SK_MSG_VERDICT: u32 = 7;
const BPF_PROG_ATTACH: libc::c_long = 8;
const BPF_PROG_DETACH: libc::c_long = 9;

/// Attaches (or, with `attach == false`, detaches) an sk_msg program to a sockmap. aya 0.14
/// only offers an attachment that is undone when its handle drops; this one belongs to the
/// (pinned) map and outlives the loader.
pub fn sk_msg_on_map(prog_fd: i32, map_fd: i32, attach: bool) -> io::Result<()> {
    let mut attr = Attr([0; 32]);
    // prog_attach/detach: target_fd, attach_bpf_fd, attach_type.
    attr.0[0] = map_fd as u32;
    attr.0[1] = prog_fd as u32;
    attr.0[2] = BPF_SK_MSG_VERDICT;
    bpf(if attach { BPF_PROG_ATTACH } else { BPF_PROG_DETACH }, &mut attr).map(drop)
}

fn obj_get(pin: &Path) -> io::Result<OwnedFd> {
    let path = path_cstring(pin)?;
    let mut attr = Attr([0; 32]);
    // obj_get: pathname (u64).
    let ptr = path.as_ptr() as u64;
    attr.0[0] = ptr as u32;
    attr.0[1] = (ptr >> 32) as u32;
    let fd = bpf(BPF_OBJ_GET, &mut attr)?;
    // SAFETY: the kernel just returned this descriptor to us.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Detaches the bpf link pinned at `pin` from its target now (`BPF_LINK_DETACH`, Linux 5.9),
/// leaving the pin for the caller to remove. Removing a link's last pin does not detach it by
/// the time `unlink(2)` returns: bpffs drops the inode's reference after an RCU grace period,
/// and the last reference of a link is then released from a workqueue, so the program can keep
/// running for a while (a CI run saw a pod's TCX counters still attached right after its
/// unenrolment). A link whose target is already gone (its netns or interface went away)
/// detaches with success.
pub fn detach_pinned_link(pin: &Path) -> io::Result<()> {
    let link = obj_get(pin)?;
    let mut attr = Attr([0; 32]);
    // link_detach: link_fd.
    attr.0[0] = link.as_raw_fd() as u32;
    bpf(BPF_LINK_DETACH, &mut attr).map(drop)
}

/// The target of the bpf link pinned at `pin`: the interface index of a TCX link, the netns
/// inode of a netns link. `Some(0)` once the kernel detached it because its target went away.
pub fn pinned_link_target(pin: &Path) -> io::Result<u32> {
    // struct bpf_link_info: type, id, prog_id, then (8-aligned, at byte 16) a union whose first
    // u32 is tcx.ifindex or netns.netns_ino.
    Ok(pinned_link_info(pin)?[4])
}

/// `struct bpf_link_info` of the link pinned at `pin`, as u32 words.
fn pinned_link_info(pin: &Path) -> io::Result<[u32; 32]> {
    let link = obj_get(pin)?;
    let mut info = [0u32; 32];
    let mut attr = Attr([0; 32]);
    let info_ptr = info.as_mut_ptr() as u64;
    attr.0[0] = link.as_raw_fd() as u32;
    attr.0[1] = size_of_val(&info) as u32;
    attr.0[2] = info_ptr as u32;
    attr.0[3] = (info_ptr >> 32) as u32;
    bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr)?;
    Ok(info)
}

const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_MAP_DELETE_ELEM: libc::c_long = 3;
const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;
const BPF_LINK_UPDATE: libc::c_long = 29;

/// Makes the bpf link pinned at `pin` run `prog_fd` instead of its program, atomically
/// (`BPF_LINK_UPDATE`, Linux 5.7 for cgroup links, 5.8 netns, 6.6 TCX): the hook never runs
/// without a program, and whatever it holds (a netns, a cgroup, an interface) stays attached.
pub fn update_pinned_link(pin: &Path, prog_fd: i32) -> io::Result<()> {
    let link = obj_get(pin)?;
    let mut attr = Attr([0; 32]);
    // link_update: link_fd, new_prog_fd, flags, old_prog_fd.
    attr.0[0] = link.as_raw_fd() as u32;
    attr.0[1] = prog_fd as u32;
    bpf(BPF_LINK_UPDATE, &mut attr).map(drop)
}

/// `map_elem` attributes: map fd, key pointer, value (or next key) pointer, flags.
fn map_elem(map: i32, key: Option<&[u8]>, value: *mut u8, flags: u64) -> Attr {
    let mut attr = Attr([0; 32]);
    attr.0[0] = map as u32;
    let key = key.map_or(0, |k| k.as_ptr() as u64);
    let value = value as u64;
    attr.0[2] = key as u32;
    attr.0[3] = (key >> 32) as u32;
    attr.0[4] = value as u32;
    attr.0[5] = (value >> 32) as u32;
    attr.0[6] = flags as u32;
    attr.0[7] = (flags >> 32) as u32;
    attr
}

/// The key after `key` (the first with `None`) in the map `map`, written to `next` (the map's
/// key size): `false` past the last. For copying entries whose layout this process does not
/// need to know.
pub fn map_next_key(map: i32, key: Option<&[u8]>, next: &mut [u8]) -> io::Result<bool> {
    let mut attr = map_elem(map, key, next.as_mut_ptr(), 0);
    match bpf(BPF_MAP_GET_NEXT_KEY, &mut attr) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Reads `key`'s value into `value` (the map's value size; per-CPU maps: every CPU's, each
/// rounded up to 8 bytes): `false` if there is none.
pub fn map_lookup(map: i32, key: &[u8], value: &mut [u8]) -> io::Result<bool> {
    let mut attr = map_elem(map, Some(key), value.as_mut_ptr(), 0);
    match bpf(BPF_MAP_LOOKUP_ELEM, &mut attr) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Writes `key`'s value (`flags`: `BPF_ANY`, `BPF_NOEXIST`, `BPF_EXIST`).
pub fn map_update(map: i32, key: &[u8], value: &[u8], flags: u64) -> io::Result<()> {
    // The kernel only reads the value of an update.
    let mut attr = map_elem(map, Some(key), value.as_ptr().cast_mut(), flags);
    bpf(BPF_MAP_UPDATE_ELEM, &mut attr).map(drop)
}

/// Deletes `key`'s entry: `false` if there was none.
pub fn map_delete(map: i32, key: &[u8]) -> io::Result<bool> {
    let mut attr = map_elem(map, Some(key), std::ptr::null_mut(), 0);
    match bpf(BPF_MAP_DELETE_ELEM, &mut attr) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
        Err(e) => Err(e),
    }
}
