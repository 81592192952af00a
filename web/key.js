// The API key, for a node started with --api-key: asked for once, when an endpoint answers
// 401, and kept in this browser (localStorage) for every later call. The page and its files
// never need it; every /v1 call carries it as "Authorization: Bearer KEY".

const STORAGE = "exo-tp-api-key";
const $ = (id) => document.getElementById(id);
let asking = null; // the open prompt, shared by every request that met a 401 meanwhile
let declined = false; // the user cancelled: the header's button asks again, polling does not

export function storedKey() {
  try {
    return localStorage.getItem(STORAGE);
  } catch {
    return null; // storage disabled: every 401 asks
  }
}

export function authHeaders(key) {
  return key ? { Authorization: `Bearer ${key}` } : {};
}

function ask(message) {
  const dialog = $("key-dialog");
  $("key-message").textContent = message;
  $("key-input").value = "";
  dialog.showModal();
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => {
      const key = $("key-input").value.trim();
      if (dialog.returnValue === "save" && key) {
        localStorage.setItem(STORAGE, key);
        declined = false;
        resolve(true);
      } else {
        declined = true;
        resolve(false);
      }
    }, { once: true });
  });
}

// A request sent with the key `used` (or none) was refused with `message`. True: retry it
// with the stored key, which another request or the user has just replaced.
export function keyRejected(used, message) {
  $("key-button").hidden = false;
  if (storedKey() !== used) return Promise.resolve(true);
  if (asking) return asking;
  if (declined) return Promise.resolve(false);
  const why = used ? `The key in this browser was refused: ${message}` : message;
  asking = ask(why).finally(() => { asking = null; });
  return asking;
}

export function installKeyDialog() {
  const dialog = $("key-dialog");
  $("key-cancel").addEventListener("click", () => dialog.close("cancel"));
  $("key-button").addEventListener("click", () => {
    if (!asking) asking = ask("The API key this node was started with (--api-key).")
      .finally(() => { asking = null; });
  });
}
