// Start-up: tabs, the API key dialog, the model name, then the two views.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);

  function selectTab(name) {
    for (const view of ["chat", "engine"]) {
      const on = view === name;
      $("tab-" + view).setAttribute("aria-selected", String(on));
      $("view-" + view).hidden = !on;
    }
    if (location.hash !== "#" + name) history.replaceState(null, "", "#" + name);
  }

  let dismissed = false;  // after Cancel, a refused poll does not reopen the dialog

  function askKey(reason, fromRefusal) {
    const dialog = $("key-dialog");
    if (dialog.open || (fromRefusal && dismissed)) return;
    $("key-reason").textContent = reason || "This server needs an API key. It is kept in this tab only (sessionStorage).";
    $("key-input").value = Api.key();
    dialog.showModal();
  }

  async function loadModel() {
    try {
      const m = await Api.modelInfo();
      $("model-name").textContent = `${m.id} · context ${m.max_model_len} tokens`;
      await loadPicker();
    } catch (e) {
      $("model-name").textContent = e.status === 401 ? "API key needed" : "server unavailable: " + e.message;
    }
  }

  // The model picker: the base model and each LoRA adapter. Rebuilt only when the list
  // changed (an open dropdown is left alone), keeping the choice while it still exists.
  async function loadPicker() {
    const select = $("model");
    const list = await Api.models();
    const ids = list.map((m) => m.id);
    if (ids.join("\n") === [...select.options].map((o) => o.value).join("\n")) return;
    const chosen = select.value;
    select.replaceChildren(...list.map((m) => {
      const option = document.createElement("option");
      option.value = m.id;
      option.textContent = m.parent ? `${m.id} (LoRA adapter)` : m.id;
      return option;
    }));
    if (ids.includes(chosen)) select.value = chosen;
  }

  function init() {
    $("tab-chat").addEventListener("click", () => selectTab("chat"));
    $("tab-engine").addEventListener("click", () => selectTab("engine"));
    $("key-button").addEventListener("click", () => askKey());
    $("model").addEventListener("focus", () => loadPicker().catch(() => {}));  // new adapters
    $("key-cancel").addEventListener("click", () => { dismissed = true; $("key-dialog").close(); });
    $("key-form").addEventListener("submit", () => {
      Api.setKey($("key-input").value.trim());
      dismissed = false;
      loadModel();
    });
    Api.onAuthNeeded = (message) => askKey(`The server refused the request (${message}). ` +
      "Enter the server's API key; it is kept in this tab only (sessionStorage).", true);
    selectTab(location.hash === "#engine" ? "engine" : "chat");
    Chat.init();
    Engine.init();
    loadModel();
  }

  init();
})();
