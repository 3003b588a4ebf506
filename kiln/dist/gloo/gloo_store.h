// A gloo::rendezvous::Store over a kiln Store, so Gloo's connectFullMesh meets through kiln's
// authenticated TCP store (Gloo at the Debian 12 snapshot has no TCP store of its own).
#pragma once
#include <gloo/rendezvous/store.h>

#include <memory>

#include "kiln/dist/store.h"

namespace kiln::dist {

class GlooStoreAdapter : public gloo::rendezvous::Store {
 public:
  explicit GlooStoreAdapter(std::shared_ptr<dist::Store> store) : store_(std::move(store)) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    store_->set(key, std::string(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    const std::string v = store_->get(key);
    return std::vector<char>(v.begin(), v.end());
  }
  void wait(const std::vector<std::string>& keys) override { store_->wait(keys); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    store_->wait(keys, timeout);
  }

 private:
  std::shared_ptr<dist::Store> store_;
};

}  // namespace kiln::dist
